"""The sandbox as a container runs it, without Docker: pid 1 of its own pid namespace, root
with only the capabilities ``preflight.CAPABILITIES`` names (no DAC override, no KILL).

Checks the three ways that setup broke before: zygotes that exited at once because their
parent was pid 1, runs that could not enter their working directory without
``DAC_OVERRIDE``, and processes inherited by pid 1 that nobody reaped."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from services.sandbox.cgroups import CGROUP_ROOT, KINDS
from services.sandbox.launcher import SandboxProcess
from services.sandbox.preflight import CAPABILITIES
from tests.integration.sandbox_client import descendants, run_code, stdout_of

pytestmark = pytest.mark.integration


def _own_cgroups(name: str) -> list[str]:
    """A cgroup of its own per controller the sandbox uses, as a container engine gives one.

    Without ``DAC_OVERRIDE`` root cannot write the hierarchies' roots (mode 0555 here); a
    cgroup made for the service (mode 0755, owned by root) is what its container would get."""
    own = {}
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(","):
                own[c] = path
    made = []
    for kind in KINDS:
        path = os.path.join(CGROUP_ROOT, kind, own[kind].lstrip("/"), name)
        os.makedirs(path, exist_ok=True)
        made.append(path)
    return made


@pytest.fixture
def service_cgroups() -> Iterator[list[str]]:
    made = _own_cgroups(f"retool-pid1-test-{os.getpid()}")
    try:
        yield made
    finally:
        for path in made:  # the service removes its own; leftovers (a failed run) go here
            for root, dirs, _ in os.walk(path, topdown=False):
                for d in dirs:
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(root, d))
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _wrapper(cgroups: list[str]) -> list[str]:
    for tool in ("unshare", "setpriv"):
        assert shutil.which(tool), f"{tool} (util-linux) is needed to run the sandbox as pid 1 here"
    caps = ",".join(f"+{c.lower()}" for c in CAPABILITIES)
    join = " && ".join(f"echo $$ > {path}/cgroup.procs" for path in cgroups)
    return ["sh", "-c", f'{join} && exec "$@"', "sh",
            "unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
            "setpriv", "--inh-caps=-all", f"--bounding-set=-all,{caps}", "--"]


def _service_pid(unshare_pid: int) -> int:
    kids = descendants(unshare_pid)
    assert kids, "unshare has no child"
    return kids[0]


def _status(pid: int, key: str) -> str:
    with open(f"/proc/{pid}/status") as fh:
        return next(line.split(":", 1)[1].strip() for line in fh if line.startswith(key + ":"))


def _zombie_children(pid: int) -> list[int]:
    zombies = []
    for child in descendants(pid):
        try:
            if _status(child, "State").startswith("Z") and int(_status(child, "PPid")) == pid:
                zombies.append(child)
        except (OSError, StopIteration):
            continue
    return zombies


def _direct_children(pid: int) -> dict[int, str]:
    """Direct children of ``pid`` and their command lines (processes that vanish are skipped)."""
    found = {}
    for child in descendants(pid):
        try:
            if int(_status(child, "PPid")) != pid:
                continue
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                found[child] = fh.read().replace(b"\0", b" ").decode()
        except (OSError, StopIteration, ValueError):
            continue
    return found


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_sandbox_as_pid_1_with_only_its_capabilities(tmp_path, service_cgroups):
    args = ["--set", "max_concurrency=4", "--set", "zygotes=1", "--set", "light_zygotes=1",
            "--set", "heavy_zygotes=0"]
    with SandboxProcess(args, log_path=str(tmp_path / "sb.log"), wrapper=_wrapper(service_cgroups)) as sb:
        service = _service_pid(sb.proc.pid)
        assert _status(service, "NSpid").split()[-1] == "1"  # pid 1 in its namespace, as in a container
        effective = int(_status(service, "CapEff"), 16)
        assert effective & (1 << 1) == 0 and effective & (1 << 5) == 0  # no DAC_OVERRIDE, no KILL
        health = httpx.get(f"{sb.url}/healthz", timeout=10).json()
        assert health["status"] == "ok" and health["zygotes_alive"] == health["zygotes"] == 2
        assert health["isolation"] == "ok" and health["cgroups"] == 1, health  # every layer, strict

        # a run enters its 0700 working directory, reads its input files and has its output fetched
        files = {"in/data.txt": base64.b64encode(b"21").decode()}
        code = "n = int(open('in/data.txt').read())\nopen('out.txt', 'w').write(str(2 * n))\nprint('ok')"
        r = run_code(sb.url, code, files=files, fetch_files=["out.txt"])
        assert r["status"] == "Success" and stdout_of(r) == "ok\n", r
        assert base64.b64decode(r["files"]["out.txt"]) == b"42"
        r = run_code(sb.url, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
        assert r["run_result"]["return_code"] == -9, r
        assert httpx.get(f"{sb.url}/healthz", timeout=10).json()["zygote_restarts"] == 0  # none exited

        # a live session works with the same capabilities: state kept, files fetched, closed cleanly
        session = httpx.post(f"{sb.url}/sessions", json={}, timeout=60).json()["session_id"]
        run_code(sb.url, "n = 21\nopen('s.txt', 'w').write('x')", session_id=session)
        r = run_code(sb.url, "2 * n", session_id=session, fetch_files=["s.txt"])
        assert stdout_of(r) == "42\n" and base64.b64decode(r["files"]["s.txt"]) == b"x", r
        assert httpx.delete(f"{sb.url}/sessions/{session}", timeout=60).json()["ended"] == "it was closed"

        # a zygote that dies takes its runs along; what it leaves behind comes to pid 1 (the
        # service), which kills and reaps it, and the zygote is replaced
        result: dict = {}
        slow = threading.Thread(target=lambda: result.update(
            run_code(sb.url, "import time\ntime.sleep(30)\nprint('finished')", run_timeout=40)))
        slow.start()
        _wait_for(lambda: httpx.get(f"{sb.url}/healthz", timeout=10).json()["in_flight"] == 1, 60, "the run")
        zygote_pids = [p for p, cmd in _direct_children(service).items() if "services.sandbox.zygote" in cmd]
        assert len(zygote_pids) == 2
        for zygote in zygote_pids:
            os.kill(zygote, signal.SIGKILL)
        slow.join(120)
        assert result["status"] == "SandboxError", result
        _wait_for(lambda: all("services.sandbox.zygote" in cmd for cmd in _direct_children(service).values()),
                  30, "pid 1 to kill and reap what the dead zygotes left")
        _wait_for(lambda: (h := httpx.get(f"{sb.url}/healthz", timeout=10).json())["zygote_restarts"] == 2
                  and h["zygotes_alive"] == 2, 120, "the zygotes to be restarted")
        assert stdout_of(run_code(sb.url, "print(6 * 7)")) == "42\n"

        # docker stop: SIGTERM to pid 1 ends the service and everything below it
        below = descendants(service)
        os.kill(service, signal.SIGTERM)
        sb.proc.wait(60)
        _wait_for(lambda: not [p for p in below if os.path.exists(f"/proc/{p}")], 30, "the zygotes to exit")
