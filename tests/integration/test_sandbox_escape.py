"""Escape probes against the real service on the host, each asserting its outcome.

What a run must not reach, probe by probe (``tests/helpers/escape_probes.py``): canary
files in world-readable host paths and host unix sockets (path and abstract); user
namespaces, mounts and the calls the filter denies; another run's processes and its /tmp;
/proc, /sys and device nodes; the CPU beyond its quota, and the service's own CPU. Each
probe runs stateless and as a session cell. The same probes run inside the compose
deployment (``tests/deploy/test_compose_smoke.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.sandbox.launcher import SandboxProcess
from tests.helpers import escape_probes as probes
from tests.integration.sandbox_client import (
    descendants,
    kill_runs_of,
    run_code,
    run_in_session,
    sandbox_pids,
    stdout_of,
    uid_of,
)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["stateless", "session"])
def run(request):
    return run_code if request.param == "stateless" else run_in_session


class Canaries:
    """World-readable files and world-connectable unix sockets on the host, removed afterwards;
    every connection a socket accepts is recorded."""

    def __init__(self) -> None:
        self.tag = f"retool-canary-{uuid.uuid4().hex[:12]}"
        t = self.tag
        self.dirs = [f"/srv/{t}", f"/opt/{t}", f"/home/{t}", f"/var/lib/{t}", f"/mnt/{t}", f"/tmp/{t}",
                     f"/var/tmp/{t}", f"/usr/local/share/{t}", f"{REPO}/.{t}"]
        self.files = [f"{d}/answers.jsonl" for d in self.dirs] + [f"/etc/{t}", f"/dev/shm/{t}"]
        self.sockets = [f"/run/{t}.sock", f"{REPO}/.{t}.sock", f"@{t}"]
        self.connections: list[str] = []
        self._listeners: list[socket.socket] = []

    def __enter__(self) -> Canaries:
        for d in self.dirs:
            os.makedirs(d, mode=0o755)
        for f in self.files:
            Path(f).write_text(f'{{"answer": "{self.tag}"}}\n')
            os.chmod(f, 0o644)
        for path in self.sockets:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind("\0" + path[1:] if path.startswith("@") else path)
            if not path.startswith("@"):
                os.chmod(path, 0o777)
            s.listen(8)
            s.settimeout(0.2)
            self._listeners.append(s)
            threading.Thread(target=self._accept, args=(s, path), daemon=True).start()
        return self

    def _accept(self, s: socket.socket, path: str) -> None:
        while True:
            try:
                conn, _ = s.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections.append(path)
            conn.close()

    def __exit__(self, *exc: object) -> None:
        for s in self._listeners:
            s.close()
        for path in self.sockets:
            if not path.startswith("@"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        for f in self.files:
            with contextlib.suppress(OSError):
                os.unlink(f)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def canaries() -> Iterator[Canaries]:
    with Canaries() as c:
        yield c


def _contained(code: str, verdict, run, url: str, **fields) -> dict:
    r = run(url, code, **fields)
    assert r["status"] == "Success", r
    seen = probes.parse(stdout_of(r))
    breaches = verdict(seen)
    assert breaches == [], (breaches, seen)
    return seen


def test_host_files_and_sockets_are_out_of_reach(sandbox_url, run, canaries):
    targets = [*canaries.files, str(REPO / "README.md"), "/etc/shadow", "/root/.bashrc",
               "/root/.pyenv/version", str(REPO / "pyproject.toml")]
    code = probes.files_probe(canaries.tag, targets, canaries.sockets)
    seen = _contained(code, lambda s: probes.verdict_files(s, canaries.tag), run, sandbox_url, run_timeout=30)
    assert canaries.connections == []
    # the view is the allowlist: no checkout, data, home, /srv, /opt, /var beyond its /tmp link
    runtime = httpx.get(f"{sandbox_url}/healthz", timeout=10).json()["runtime"]
    bound = runtime["host_paths_in_root"]
    # plus the first component of each bound runtime path (e.g. /root or the checkout's top dir):
    # only the path down to the runtime, which the check below pins
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr", "var",
               *(Path(p).parts[1] for p in bound if len(Path(p).parts) > 1)}
    assert set(seen["root"]) <= allowed, (seen["root"], bound)
    probe = ("import json, os, sys\n"
             "dirs = (sys.prefix, sys.base_prefix, *sys.path)\n"
             "print(json.dumps([os.path.realpath(p) for p in dirs if p]))")
    found = subprocess.run([runtime["python"], "-s", "-c", probe], capture_output=True, text=True, check=True,
                           cwd="/")
    runtime_dirs = json.loads(found.stdout)
    assert str(REPO) not in bound and "/" not in bound, bound
    for path in bound:  # /usr, else the runtime's own directories (its prefixes, its sys.path)
        assert path == "/usr" or any(path == d or d.startswith(path + "/") or path.startswith(d + "/")
                                     for d in runtime_dirs if d != "/"), (path, runtime_dirs)
    # /etc/passwd is the tree's own: accounts for root, nobody and the run uids, no host user
    passwd = stdout_of(run(sandbox_url, "print(open('/etc/passwd').read())"))
    host_users = {line.split(":")[0] for line in Path("/etc/passwd").read_text().splitlines()}
    tree_users = {line.split(":")[0] for line in passwd.splitlines() if line}
    assert tree_users & host_users <= {"root", "nobody"}, tree_users & host_users


def test_no_user_namespaces_mounts_or_filtered_calls(sandbox_url, run):
    seen = _contained(probes.kernel_probe(), probes.verdict_kernel, run, sandbox_url)
    assert seen["unshare -U -r id"].startswith("FAILED")


def test_no_proc_sys_writes_and_only_the_allowed_devices(sandbox_url, run):
    _contained(probes.proc_probe(), probes.verdict_proc, run, sandbox_url)


def _run_pids(service_pid: int, before: set[int]) -> list[int]:
    return [p for p in descendants(service_pid) if p not in before and (uid_of(p) or 0) >= 61000]


def test_another_runs_processes_and_tmp_are_out_of_reach(sandbox, sandbox_url, run):
    tag = uuid.uuid4().hex
    before = set(sandbox_pids())
    victim: dict = {}
    holder = threading.Thread(target=lambda: victim.update(
        run_code(sandbox_url, probes.victim(tag, 8), run_timeout=60)))
    holder.start()
    deadline = time.monotonic() + 60
    while not (pids := _run_pids(sandbox.proc.pid, before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids, "the victim run never started"
    _contained(probes.neighbour_probe(tag, pids), probes.verdict_neighbour, run, sandbox_url)
    holder.join(90)
    assert stdout_of(victim) == "ready\nsurvived\n", victim  # neither killed nor disturbed


def _cpu_quota(seen: dict) -> float:
    """Cores the run's cpu cgroup allows (read on the host; v1 cfs files, else v2 cpu.max)."""
    v1 = [p for p in seen["cgroup"] if p != "/"]
    base = Path("/sys/fs/cgroup/cpu") / v1[0].lstrip("/")
    if (base / "cpu.cfs_quota_us").exists():
        return int((base / "cpu.cfs_quota_us").read_text()) / int((base / "cpu.cfs_period_us").read_text())
    quota, period = (Path("/sys/fs/cgroup") / v1[0].lstrip("/") / "cpu.max").read_text().split()
    return int(quota) / int(period)


def test_a_runs_threads_share_its_cpu_quota(sandbox_url):
    """A run's cpu cgroup holds its quota (1 core by default, less if asked), and four spinning
    threads never get more (on a busy machine they may get less)."""
    full = probes.parse(stdout_of(run_code(sandbox_url, probes.cpu_share_probe(4), run_timeout=30)))
    assert _cpu_quota(full) == 1.0 and full["cores"] <= 1.25, full
    half = probes.parse(stdout_of(run_code(sandbox_url, probes.cpu_share_probe(4), run_timeout=30,
                                           cpu_cores=0.5)))
    assert _cpu_quota(half) == 0.5 and half["cores"] <= 0.7, half
    over = run_code(sandbox_url, "print(1)", cpu_cores=8)
    assert "cpu_cores 8 clamped" in over["message"], over


def test_cpu_hogs_leave_the_service_and_a_hello_run_working(tmp_path):
    """128 runs spin on every core they can get; /healthz still answers within a second and a
    hello run completes (the runs share one parent cgroup that weighs as much as the cores)."""
    args = ["--set", "max_concurrency=130", "--set", "zygotes=1", "--set", "light_zygotes=1",
            "--set", "heavy_zygotes=0", "--set", "max_sessions=0"]
    with SandboxProcess(args, log_path=str(tmp_path / "sb.log")) as sb:
        hogs: list[dict] = []
        spin = "while True:\n    pass\n"
        threads = [threading.Thread(target=lambda: hogs.append(run_code(sb.url, spin, run_timeout=120)))
                   for _ in range(128)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 180
            while len(_run_pids(sb.proc.pid, set())) < 128:
                assert time.monotonic() < deadline, "the 128 hogs never ran at once"
                time.sleep(0.2)
            times = []
            for _ in range(5):
                start = time.monotonic()
                health = httpx.get(f"{sb.url}/healthz", timeout=30)
                times.append(time.monotonic() - start)
                assert health.status_code == 200 and health.json()["in_flight"] >= 128
            assert statistics.median(times) < 1.0 and max(times) < 5.0, times
            hello = run_code(sb.url, "print('hello')", run_timeout=60)
            assert hello["status"] == "Success" and stdout_of(hello) == "hello\n", hello
        finally:
            while any(t.is_alive() for t in threads):  # end the hogs (their runs answer Failed)
                kill_runs_of(sb.proc.pid)
                time.sleep(0.2)
        assert len(hogs) == 128 and all(h["status"] == "Failed" for h in hogs)


def _no_cgroup_wrapper() -> list[str]:
    """Root without DAC_OVERRIDE: the cgroup hierarchies' roots (mode 0555) are not writable, so
    the pids and cpu controllers are unusable, as in a container without its own cgroups."""
    from services.sandbox.preflight import CAPABILITIES

    caps = ",".join(f"+{c.lower()}" for c in CAPABILITIES)
    return ["setpriv", "--inh-caps=-all", f"--bounding-set=-all,{caps}", "--"]


def test_without_its_limits_the_service_refuses_to_start_unless_told_degraded(tmp_path):
    args = ["--set", "max_concurrency=2", "--set", "zygotes=1", "--set", "light_zygotes=0",
            "--set", "heavy_zygotes=0"]
    log = tmp_path / "strict.log"
    with pytest.raises(RuntimeError, match="exited with code"), \
            SandboxProcess(args, log_path=str(log), wrapper=_no_cgroup_wrapper()):
        pass
    assert "cannot enforce" in log.read_text() and "isolation: degraded" in log.read_text()
    degraded = [*args, "--set", "isolation=degraded"]
    wrapper = _no_cgroup_wrapper()
    with SandboxProcess(degraded, log_path=str(tmp_path / "degraded.log"), wrapper=wrapper) as sb:
        health = httpx.get(f"{sb.url}/healthz", timeout=10)
        body = health.json()
        assert body["isolation"] == "degraded" and body["isolation_gaps"], body
        assert any("cgroup" in g for g in body["isolation_gaps"]), body
        assert "degraded" in health.headers["x-sandbox-isolation"]
        r = httpx.post(f"{sb.url}/run_code", json={"code": "print(1)"}, timeout=60)
        assert r.json()["status"] == "Success" and r.json()["message"].startswith("isolation degraded:")
        assert "degraded" in r.headers["x-sandbox-isolation"]
        bad = httpx.post(f"{sb.url}/run_code", json={"code": "1", "language": "ruby"}, timeout=60)
        assert bad.status_code == 422 and "degraded" in bad.headers["x-sandbox-isolation"]
