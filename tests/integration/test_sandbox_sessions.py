"""Live interpreter sessions against the real sandbox service (real zygotes, namespaces, cgroups).

Every wait is for a condition with a deadline; the containment tests of the stateless mode
run in session mode too (``test_sandbox_isolation``, parametrized by ``run``)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import httpx
import pytest

from services.sandbox.launcher import SandboxProcess
from tests.integration.sandbox_client import (
    close_session,
    descendants,
    open_session,
    run_code,
    sandbox_pids,
    stderr_of,
    stdout_of,
    uid_of,
)

pytestmark = pytest.mark.integration


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _cell(url: str, session: str, code: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/run_code", json={"code": code, "session_id": session, **fields}, timeout=120)


def test_turn_two_sees_turn_one_and_last_expression_is_displayed(sandbox_url):
    s = open_session(sandbox_url)
    try:
        assert _cell(sandbox_url, s, "import random\nx = 41\nseq = [random.random() for _ in range(3)]"
                     ).json()["status"] == "Success"
        r = run_code(sandbox_url, "x += 1\nprint('x is', x)\nx * 2", session_id=s)
        assert r["status"] == "Success" and stdout_of(r) == "x is 42\n84\n"
        err = run_code(sandbox_url, "def f():\n    return 1 / 0\nf()", session_id=s)
        assert err["status"] == "Failed" and "ZeroDivisionError" in stderr_of(err)
        assert "services" not in stderr_of(err) and "session_main" not in stderr_of(err)
        # the exception ended the cell, not the session; state set before it stays; None is not shown
        r = run_code(sandbox_url, "y = None\ny\nlen(seq), x", session_id=s)
        assert stdout_of(r) == "(3, 42)\n"
        assert stdout_of(run_code(sandbox_url, "None", session_id=s)) == ""
        exited = run_code(sandbox_url, "import sys\nsys.exit(3)", session_id=s)  # as in a notebook: the
        assert exited["status"] == "Failed" and exited["run_result"]["return_code"] == 3  # session lives
        # a cell that breaks builtins and the module table breaks its own code only, not the cell loop
        run_code(sandbox_url, "import builtins, sys\nbuiltins.isinstance = None\nbuiltins.repr = None\n"
                 "builtins.BaseException = None\nsys.modules.clear()", session_id=s)
        assert stdout_of(run_code(sandbox_url, "print(x)\nx - 1", session_id=s)) == "42\n41\n"
    finally:
        close_session(sandbox_url, s)


def test_two_sessions_are_isolated(sandbox_url):
    a, b = open_session(sandbox_url), open_session(sandbox_url)
    try:
        tag = uuid.uuid4().hex
        ra = run_code(sandbox_url, f"import os\nsecret = '{tag}'\nopen('{tag}', 'w').write('a')\n"
                      "print(os.getuid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))",
                      session_id=a)
        rb = run_code(sandbox_url, "import os\nprint(os.getuid(), sorted(int(p) for p in os.listdir('/proc') "
                      "if p.isdigit()), os.listdir('.'))\nprint('secret' in globals())", session_id=b)
        uid_a, procs_a = stdout_of(ra).split(" ", 1)
        first, second = stdout_of(rb).splitlines()
        uid_b, rest = first.split(" ", 1)
        assert uid_a != uid_b and int(uid_a) >= 1000 and int(uid_b) >= 1000
        assert procs_a.strip() == "[2]" and rest == "[2] []" and second == "False"  # pid 1 is hidden
        # b cannot reach a's files by any path, nor signal it
        probe = (f"import glob, os\nprint(glob.glob('/proc/*/root/tmp/workspace/{tag}'), "
                 f"glob.glob('/tmp/**/{tag}', recursive=True))\n"
                 "try:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\nprint('alive')")
        assert stdout_of(run_code(sandbox_url, probe, session_id=b)) == "[] []\nalive\n"
        assert stdout_of(run_code(sandbox_url, "secret", session_id=a)) == f"'{tag}'\n"
    finally:
        close_session(sandbox_url, a)
        close_session(sandbox_url, b)


def _mounts_with_device(dev: int) -> list[str]:
    """Mount points on the host (any process's view) of the file system with device ``dev``."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/mountinfo") as fh:
                found += [f"{pid}:{line.split()[4]}" for line in fh if line.split()[2] == want]
        except OSError:
            continue
    return found


def _fds_on_device(pid: int, dev: int) -> list[str]:
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.stat(f"/proc/{pid}/fd/{fd}").st_dev == dev:
                held.append(fd)
        except OSError:
            continue
    return held


def test_idle_session_expires_with_its_processes_and_files(sandbox, sandbox_url):
    s = open_session(sandbox_url, ttl_s=1.0)
    tag = uuid.uuid4().hex
    r = run_code(sandbox_url, f"import subprocess\nopen('{tag}', 'w').write('x')\n"
                 "child = subprocess.Popen(['sleep', '300'])\nprint('ok')", session_id=s)
    assert stdout_of(r) == "ok\n", r
    init, interpreter = httpx.get(f"{sandbox_url}/sessions/{s}", timeout=10).json()["pids"]
    assert uid_of(interpreter) is not None and uid_of(interpreter) >= 1000
    workdir = f"/proc/{interpreter}/root/tmp/workspace"
    assert os.path.exists(f"{workdir}/{tag}")
    tmp_dev = os.stat(f"/proc/{interpreter}/root/tmp").st_dev
    zygote = next(p for p in (int(x) for x in os.listdir("/proc") if x.isdigit())
                  if _ppid(interpreter) == p)
    assert _mounts_with_device(tmp_dev)
    _wait_for(lambda: httpx.get(f"{sandbox_url}/sessions/{s}", timeout=10).status_code == 410, 30,
              "the idle session to expire")
    _wait_for(lambda: not os.path.exists(f"/proc/{init}") and not os.path.exists(f"/proc/{interpreter}"),
              10, "the session's processes to end")
    assert sandbox_pids(under=sandbox.proc.pid) == []  # the sleep it started is gone too
    assert _mounts_with_device(tmp_dev) == [] and _fds_on_device(zygote, tmp_dev) == []  # tmpfs freed
    r = _cell(sandbox_url, s, "print(1)")
    assert r.status_code == 410 and "idle longer than its TTL" in r.json()["detail"]
    assert _cell(sandbox_url, "nope", "print(1)").status_code == 404
    metrics = httpx.get(f"{sandbox_url}/metrics", timeout=10).text
    assert 'sandbox_sessions_ended_total{reason="expired"}' in metrics


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("PPid:"))


def test_live_session_limit_answers_429_with_a_clear_message(sandbox_url):
    limit = httpx.get(f"{sandbox_url}/healthz", timeout=10).json()["max_sessions"]
    opened = []
    try:
        for _ in range(limit + 1):
            r = httpx.post(f"{sandbox_url}/sessions", json={}, timeout=120)
            if r.status_code != 200:
                break
            opened.append(r.json()["session_id"])
        assert r.status_code == 429 and len(opened) == limit
        assert f"max_sessions={limit}" in r.json()["detail"] and "DELETE /sessions" in r.json()["detail"]
        live = [line for line in httpx.get(f"{sandbox_url}/metrics", timeout=10).text.splitlines()
                if line.startswith("sandbox_sessions_live ")]
        assert live == [f"sandbox_sessions_live {float(limit)}"]
        mem = next(line for line in httpx.get(f"{sandbox_url}/metrics", timeout=10).text.splitlines()
                   if line.startswith("sandbox_sessions_memory_bytes "))
        assert float(mem.split()[1]) > 0
        close_session(sandbox_url, opened.pop())
        opened.append(open_session(sandbox_url))  # a freed place can be taken again
    finally:
        for s in opened:
            close_session(sandbox_url, s)


def test_memory_bomb_kills_only_its_own_session(sandbox, sandbox_url):
    keeper = open_session(sandbox_url)
    bomb = open_session(sandbox_url, memory_limit_MB=256)
    try:
        run_code(sandbox_url, "kept = list(range(10))", session_id=keeper)
        # a big allocation within one process is refused (MemoryError); the session lives on
        r = run_code(sandbox_url, "x = bytearray(2 * 1024**3)", session_id=bomb)
        assert "MemoryError" in stderr_of(r)
        assert stdout_of(run_code(sandbox_url, "1 + 1", session_id=bomb)) == "2\n"
        # children hold 4 x 100 MB, then the interpreter grows until the session's cgroup is full:
        # the kernel kills the largest process, the interpreter, and the session is over
        code = """
import os, time
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        b = bytearray(100 * 2**20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        open(f"held-{os.getpid()}", "w").close()
        time.sleep(300)
        os._exit(0)
    kids.append(pid)
deadline = time.monotonic() + 30
while not all(os.path.exists(f"held-{p}") for p in kids) and time.monotonic() < deadline:
    time.sleep(0.05)
grow = []
while True:
    chunk = bytearray(8 * 2**20)
    for i in range(0, len(chunk), 4096):
        chunk[i] = 1
    grow.append(chunk)
"""
        r = run_code(sandbox_url, code, session_id=bomb, run_timeout=50)
        assert r["status"] == "Failed" and "memory limit of 256 MB" in r["message"], r
        after = _cell(sandbox_url, bomb, "1")
        assert after.status_code == 410 and "memory limit" in after.json()["detail"]
        assert stdout_of(run_code(sandbox_url, "kept[-1]", session_id=keeper)) == "9\n"
    finally:
        close_session(sandbox_url, keeper)
        close_session(sandbox_url, bomb)
    _wait_for(lambda: sandbox_pids(under=sandbox.proc.pid) == [], 10, "the sessions' processes to end")


def test_a_cell_past_its_time_limit_ends_the_session_and_says_so(sandbox, sandbox_url):
    s = open_session(sandbox_url)
    spin = "print('started', flush=True)\nwhile True:\n    pass"
    r = run_code(sandbox_url, spin, session_id=s, run_timeout=1)
    assert r["run_result"]["status"] == "TimeLimitExceeded" and stdout_of(r) == "started\n"
    assert "time limit of 1 s" in r["message"]
    after = _cell(sandbox_url, s, "1")
    assert after.status_code == 410 and "time limit" in after.json()["detail"]
    s2 = open_session(sandbox_url)
    r = run_code(sandbox_url, "import os\nos._exit(7)", session_id=s2)
    assert r["status"] == "Failed" and "exited with code 7" in r["message"], r
    assert _cell(sandbox_url, s2, "1").status_code == 410
    _wait_for(lambda: sandbox_pids(under=sandbox.proc.pid) == [], 10, "the sessions' processes to end")


def test_files_in_and_out_of_a_session(sandbox_url):
    import base64

    s = open_session(sandbox_url)
    try:
        files = {"data/in.txt": base64.b64encode(b"21").decode()}
        r = run_code(sandbox_url, "n = int(open('data/in.txt').read())", session_id=s, files=files)
        assert r["status"] == "Success", r
        r = run_code(sandbox_url, "open('out.txt', 'w').write(str(2 * n))", session_id=s,
                     fetch_files=["out.txt", "../../etc/passwd"])
        assert base64.b64decode(r["files"]["out.txt"]) == b"42"
        assert "../../etc/passwd" not in r["files"] and "skipped" in r["message"]
        assert _cell(sandbox_url, s, "1", stdin="x").status_code == 422
    finally:
        close_session(sandbox_url, s)


def test_run_jupyter_accepts_a_sandboxfusion_client_request(sandbox_url):
    """The request SandboxFusion's client sends (its documented example cells), answered in its shape."""
    request = {"cells": ["a = 123", "a", "print(a)", 'import sys; sys.stderr.write("stderr message")',
                         'raise RuntimeError("error message")'],
               "cell_timeout": 0, "total_timeout": 45, "kernel": "python3", "files": {}, "fetch_files": []}
    body = httpx.post(f"{sandbox_url}/run_jupyter", json=request, timeout=120).json()
    # as SandboxFusion: every cell ran, so the notebook succeeded; the failing cell says so itself
    assert body["status"] == "Success" and body["driver"]["status"] == "Finished"
    cells = body["cells"]
    assert len(cells) == 5
    assert [c["display"] for c in cells[:2]] == [[], [{"text/plain": "123"}]]
    assert cells[2]["stdout"] == "123\n" and cells[3]["stderr"] == "stderr message"
    error = cells[4]["error"][0]
    assert error["ename"] == "RuntimeError" and error["evalue"] == "error message"
    after = httpx.post(f"{sandbox_url}/run_jupyter", json={"cells": ["x = 1", "1 / 0", "print(x + 1)"]},
                       timeout=120).json()
    assert after["status"] == "Success" and [c["stdout"] for c in after["cells"]] == ["", "", "2\n"], after
    assert after["cells"][1]["error"][0]["ename"] == "ZeroDivisionError"
    # replaying cells re-runs them from scratch; a live session runs only the new one
    s = open_session(sandbox_url)
    try:
        cells = ["import random\nr = random.random()"]
        first = httpx.post(f"{sandbox_url}/run_jupyter", json={"cells": cells, "session_id": s},
                           timeout=120).json()
        assert first["status"] == "Success"
        again = httpx.post(f"{sandbox_url}/run_jupyter", json={"cells": ["r"], "session_id": s},
                           timeout=120).json()
        assert again["status"] == "Success" and again["cells"][0]["display"][0]["text/plain"].startswith("0.")
    finally:
        close_session(sandbox_url, s)
    slow = httpx.post(f"{sandbox_url}/run_jupyter", json={"cells": ["import time", "time.sleep(30)", "1"],
                                                          "total_timeout": 1.5}, timeout=120).json()
    assert slow["status"] == "Failed" and slow["driver"]["status"] == "TimeLimitExceeded", slow
    assert len(slow["cells"]) == 2 and slow["cells"][1]["error"][0]["ename"] == "TimeoutError"
    bad = httpx.post(f"{sandbox_url}/run_jupyter", json={"cells": ["1"], "kernel": "ruby"}, timeout=30)
    assert bad.status_code == 422 and "kernel" in bad.text


def _session_tree(url: str, session: str) -> list[int]:
    """Host pids of a session's processes: init, its interpreter, and what the interpreter started."""
    init, interpreter = httpx.get(f"{url}/sessions/{session}", timeout=10).json()["pids"]
    return [init, interpreter, *descendants(interpreter)]


def test_sessions_end_with_their_worker_and_with_the_service(tmp_path):
    """A session never outlives its zygote (its init ends with the zygote), nor the service."""
    args = ["--set", "max_concurrency=2", "--set", "zygotes=1", "--set", "light_zygotes=0",
            "--set", "heavy_zygotes=0", "--set", "max_sessions=4"]
    spawn = "import subprocess\nsubprocess.Popen(['sleep', '300'])\nsubprocess.Popen(['sleep', '301'])\n'up'"
    with SandboxProcess(args, log_path=str(tmp_path / "sb.log")) as sb:
        s = open_session(sb.url)
        assert stdout_of(run_code(sb.url, spawn, session_id=s)) == "'up'\n"
        tree = _session_tree(sb.url, s)
        assert len(tree) == 4
        zygote = _ppid(tree[1])
        os.kill(zygote, signal.SIGKILL)
        _wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in tree), 30,
                  "the session's processes to end with their zygote")
        _wait_for(lambda: (h := httpx.get(f"{sb.url}/healthz", timeout=10).json())["zygote_restarts"] == 1
                  and h["zygotes_alive"] == 1, 120, "the zygote to be restarted")
        r = _cell(sb.url, s, "1")
        assert r.status_code == 410 and "worker" in r.json()["detail"], r.text
        s2 = open_session(sb.url)  # the restarted zygote holds new sessions
        assert stdout_of(run_code(sb.url, spawn, session_id=s2)) == "'up'\n"
        tree = _session_tree(sb.url, s2)
        os.kill(sb.proc.pid, signal.SIGKILL)  # the service itself, without any chance to clean up
        _wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in tree), 30,
                  "the session's processes to end with the service")
