"""The sandbox container's seccomp profile (services/sandbox/container_profile.py).

The committed JSON is what the generator writes; it denies what the runs' filter denies but
exactly the calls the service needs; argument checks cannot be widened with high bits. Under a
real Docker engine the compose smoke test probes it (tests/deploy/container_seccomp.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.sandbox import container_profile as cp
from services.sandbox import linux, syscall_filter, syscall_table

ROOT = Path(__file__).resolve().parents[2]


def _rules(name: str) -> list[dict]:
    return [r for r in cp.profile()["syscalls"] if name in r["names"]]


def _allowed(name: str, args: tuple[int, ...]) -> bool:
    """Whether the profile allows ``name(*args)``, evaluated as libseccomp does (64-bit arguments;
    one rule's comparisons all hold; the first matching rule's action, else the default)."""
    ops = {"SCMP_CMP_EQ": lambda a, v, _: a == v, "SCMP_CMP_MASKED_EQ": lambda a, m, want: a & m == want}
    for rule in _rules(name):
        if all(ops[c["op"]](args[c["index"]], c["value"], c["valueTwo"]) for c in rule.get("args", [])):
            return rule["action"] == "SCMP_ACT_ALLOW"
    return cp.profile()["defaultAction"] == "SCMP_ACT_ALLOW"


def test_committed_profile_is_current():
    committed = (ROOT / cp.PROFILE_PATH).read_text()
    assert committed == cp.render(), f"{cp.PROFILE_PATH} is stale: run scripts/gen_seccomp_profile.py"
    proc = subprocess.run([sys.executable, "scripts/gen_seccomp_profile.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_check_mode_reports_a_stale_file(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "deploy" / "docker").mkdir(parents=True)
    script = tmp_path / "scripts" / "gen_seccomp_profile.py"
    script.write_text((ROOT / "scripts" / "gen_seccomp_profile.py").read_text())
    (tmp_path / "services").symlink_to(ROOT / "services")
    (tmp_path / cp.PROFILE_PATH).write_text(cp.render().replace('"mount"', '"mount2"', 1))
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "stale" in proc.stderr


def test_default_denies_with_eperm_and_only_x86_64():
    p = cp.profile()
    assert (p["defaultAction"], p["defaultErrnoRet"], p["architectures"]) == ("SCMP_ACT_ERRNO", 1,
                                                                               ["SCMP_ARCH_X86_64"])
    names = [n for r in p["syscalls"] for n in r["names"]]
    assert set(names) <= set(syscall_table.X86_64)  # nothing of another ABI, no misspelling


def test_denies_the_runs_denials_but_the_services_own_calls():
    allowed = set(cp.allowed_calls())
    for name in syscall_filter.denied_calls():
        assert (name in allowed) == (name in cp.SERVICE_CALLS), name
        # none is let in by argument but unshare and setns, for the service's namespaces
        assert bool(_rules(name)) == (name in allowed or name in ("unshare", "setns")), name
    for name in ("bpf", "keyctl", "add_key", "ptrace", "perf_event_open", "userfaultfd", "io_uring_setup",
                 "process_vm_readv", "kexec_load", "init_module", "modify_ldt", "fanotify_init", "chroot"):
        assert not _allowed(name, (0,) * 6), name
    for name in ("mount", "umount2", "pivot_root", "sethostname", "read", "execve", "seccomp", "prctl"):
        assert _allowed(name, (0,) * 6), name
    # every call of the table is either allowed outright, argument-checked or denied
    assert set(syscall_table.X86_64) == allowed | set(cp.ARG_CHECKED) | (
        set(cp.denied_calls()) & set(syscall_table.X86_64))


def test_namespaces_only_those_the_service_makes():
    ns = {"NS": linux.CLONE_NEWNS, "UTS": linux.CLONE_NEWUTS, "IPC": linux.CLONE_NEWIPC,
          "NET": linux.CLONE_NEWNET, "PID": linux.CLONE_NEWPID}
    for flag in ns.values():
        assert _allowed("unshare", (flag,))
    assert _allowed("unshare", (sum(ns.values()),))
    for bad in (linux.CLONE_NEWUSER, linux.CLONE_NEWCGROUP, linux.CLONE_NEWTIME):
        assert not _allowed("unshare", (bad,)) and not _allowed("unshare", (bad | linux.CLONE_NEWNS,))
        assert not _allowed("clone", (bad | 17, 0, 0, 0, 0))
    assert _allowed("clone", (17, 0, 0, 0, 0))  # fork
    assert _allowed("clone", (linux.CLONE_VM | linux.CLONE_FILES | 17, 0, 0, 0, 0))  # a run's init
    assert not _allowed("clone", (linux.CLONE_NEWNET | 17, 0, 0, 0, 0))  # the service only unshares
    assert _allowed("setns", (3, linux.CLONE_NEWNET)) and _allowed("setns", (3, linux.CLONE_NEWPID))
    for nstype in (0, linux.CLONE_NEWUSER, linux.CLONE_NEWNS, linux.CLONE_NEWNET | 1 << 32):
        assert not _allowed("setns", (3, nstype)), hex(nstype)
    assert [r.get("errnoRet") for r in _rules("clone3")] == [38]  # ENOSYS: glibc falls back to clone


def test_socket_families_as_the_runs_filter_and_high_bits_change_nothing():
    for family in range(cp.AF_MAX):
        want = family not in syscall_filter.DENIED_SOCKET_FAMILIES
        assert _allowed("socket", (family, 1, 0)) is want, family
        assert _allowed("socket", (family | 1 << 32, 1, 0)) is want, family  # the kernel reads an int
    assert not _allowed("socket", (cp.AF_MAX, 1, 0))
    assert cp.aligned_blocks({0, 1, 2, 3, 5, 6, 7}) == [(0, 4), (5, 1), (6, 2)]


def test_personality_only_its_query():
    assert _allowed("personality", (0xFFFFFFFF,))
    assert not _allowed("personality", (0x40000,)) and not _allowed("personality", (0x1FFFFFFFF,))


def test_profile_is_valid_json_in_the_oci_shape():
    p = json.loads((ROOT / cp.PROFILE_PATH).read_text())
    assert set(p) == {"defaultAction", "defaultErrnoRet", "architectures", "syscalls"}
    for rule in p["syscalls"]:
        assert set(rule) <= {"names", "action", "errnoRet", "args"}, rule
        for arg in rule.get("args", []):
            assert set(arg) == {"index", "value", "valueTwo", "op"} and 0 <= arg["value"] < 1 << 64
