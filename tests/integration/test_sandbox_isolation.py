"""Every isolation rule of the sandbox, each its own test, against a real server.

After each hostile run the service must keep answering (``_assert_service_ok``).
"""

from __future__ import annotations

import json
import os
import time
import uuid

import httpx
import pytest

from tests.conftest import SANDBOX_SECRET
from tests.helpers.hostile_code import MemoryBombVerdict, forked_memory_bomb
from tests.integration.sandbox_client import run_code, run_in_session, sandbox_pids, stderr_of, stdout_of

pytestmark = pytest.mark.integration


@pytest.fixture(params=["stateless", "session"])
def run(request):
    """The hostile code runs as a stateless run, or as a cell of a live session (closed after)."""
    return run_code if request.param == "stateless" else run_in_session


def _assert_service_ok(url: str) -> None:
    assert httpx.get(f"{url}/healthz", timeout=10).json()["status"] == "ok"
    assert stdout_of(run_code(url, "print(6*7)")) == "42\n"


def _wait_no_sandbox_processes(service_pid: int, timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := sandbox_pids(under=service_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_each_run_gets_its_own_empty_workdir(sandbox_url):
    code = "import os\nprint(os.getcwd(), os.listdir('.'))\nopen('mine.txt','w').write('1')"
    r = run_code(sandbox_url, code)
    cwd, listing = stdout_of(r).split(" ", 1)
    assert listing.strip() == "[]"
    again = run_code(sandbox_url, "import os\nprint(os.listdir('.'))")
    assert stdout_of(again).strip() == "[]"
    assert not os.path.exists(os.path.join(cwd, "mine.txt"))  # not on the host either


def test_no_network_not_even_loopback(sandbox, sandbox_url, redis_server, run):
    port = int(sandbox_url.rsplit(":", 1)[1])
    code = f"""
import socket
print(sorted(name for _, name in socket.if_nameindex()))
for port in ({redis_server.port}, {port}, 6379):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port))
        print("CONNECTED", port)
    except OSError as exc:
        print("blocked", port, exc.errno)
"""
    out = stdout_of(run(sandbox_url, code))
    assert "CONNECTED" not in out
    assert out.count("blocked") == 3
    assert out.splitlines()[0] == "['lo']"
    _assert_service_ok(sandbox_url)


def test_writes_outside_the_workdir_are_invisible_to_host_and_later_runs(sandbox_url, run):
    tag = uuid.uuid4().hex
    targets = [f"/tmp/{tag}", f"/var/tmp/{tag}", f"/dev/shm/{tag}", f"/etc/{tag}", f"{os.getcwd()}/{tag}",
               f"/usr/{tag}"]
    code = "\n".join([
        "ok = []",
        f"for p in {targets!r}:",
        "    try:",
        "        open(p, 'w').write('x'); ok.append(p)",
        "    except OSError:",
        "        pass",
        "import json",
        "print(json.dumps(ok))",
    ])
    r = run(sandbox_url, code)
    assert r["status"] == "Success"
    written = json.loads(stdout_of(r))
    assert f"/etc/{tag}" not in written and f"/usr/{tag}" not in written
    for path in targets:
        assert not os.path.exists(path), path
    check = run_code(sandbox_url, f"import os\nprint([p for p in {targets!r} if os.path.exists(p)])")
    assert stdout_of(check).strip() == "[]"


def test_service_environment_and_secrets_are_unreadable(sandbox, sandbox_url, run):
    code = f"""
import os, glob
found = []
if any({SANDBOX_SECRET!r} in v for v in os.environ.values()):
    found.append("os.environ")
for path in glob.glob("/proc/*/environ") + ["/proc/{sandbox.proc.pid}/environ", "/proc/self/environ"]:
    try:
        if {SANDBOX_SECRET!r}.encode() in open(path, "rb").read():
            found.append(path)
    except OSError:
        pass
print("FOUND", found)
print("KEYS", sorted(os.environ))
"""
    out = stdout_of(run(sandbox_url, code))
    assert "FOUND []" in out, out
    assert "RETOOL_WEIGHT_TOKEN" not in out


def test_only_the_runs_own_processes_are_visible(sandbox, sandbox_url, run):
    code = ("import json, os\nprint(json.dumps([sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),\n"
            "      os.getpid(), os.path.exists('/proc/1'), sorted(os.listdir('/proc'))[-2:]]))")
    pids, own, init_visible, rest = json.loads(stdout_of(run(sandbox_url, code)))
    # pid 1 of the namespace (its holder, root) is hidden from the run (hidepid); the run is
    # pid 2, so its own signals act; /proc holds nothing but pid directories (subset=pid)
    assert pids == [2] and own == 2 and init_visible is False
    assert rest == ["self", "thread-self"]


def test_cannot_signal_or_kill_the_service(sandbox, sandbox_url, run):
    code = f"""
import os, signal
for attempt in (lambda: os.kill({sandbox.proc.pid}, signal.SIGKILL),
                lambda: os.killpg({sandbox.proc.pid}, signal.SIGKILL),
                lambda: os.kill(1, signal.SIGKILL),
                lambda: os.kill(-1, signal.SIGKILL)):
    try:
        attempt()
    except OSError as exc:
        print("refused", exc.errno)
"""
    run(sandbox_url, code)
    assert sandbox.proc.poll() is None
    _assert_service_ok(sandbox_url)


def test_runs_as_unprivileged_uid_without_new_privileges(sandbox_url, run):
    code = ("import os\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())\n"
            "print([l for l in open('/proc/self/status') if l.startswith(('NoNewPrivs', 'CapEff'))])")
    out = stdout_of(run(sandbox_url, code))
    uid, euid, gid, groups = out.splitlines()[0].split(" ", 3)
    assert int(uid) >= 1000 and uid == euid == gid and groups == "[]"
    assert "NoNewPrivs:\\t1" in out and "CapEff:\\t0000000000000000" in out


def test_background_children_die_with_the_run(sandbox, sandbox_url):
    code = """
import os, subprocess
subprocess.Popen(["sleep", "300"], start_new_session=True)
if os.fork() == 0:          # a classic double-fork daemon
    os.setsid()
    if os.fork() == 0:
        import time
        time.sleep(300)
    os._exit(0)
print("spawned")
"""
    r = run_code(sandbox_url, code)
    assert stdout_of(r) == "spawned\n"
    assert _wait_no_sandbox_processes(sandbox.proc.pid) == []


def test_timeout_kills_the_whole_process_tree(sandbox, sandbox_url):
    code = ("import subprocess, time\n"
            "for _ in range(3): subprocess.Popen(['sleep', '300'])\n"
            "while True: time.sleep(0.1)\n")
    r = run_code(sandbox_url, code, run_timeout=1)
    assert r["run_result"]["status"] == "TimeLimitExceeded"
    assert _wait_no_sandbox_processes(sandbox.proc.pid) == []
    _assert_service_ok(sandbox_url)


def test_cpu_bound_timeout(sandbox_url):
    start = time.monotonic()
    r = run_code(sandbox_url, "while True: pass", run_timeout=1)
    assert r["run_result"]["status"] == "TimeLimitExceeded"
    assert time.monotonic() - start < 10


def test_fork_bomb_is_contained(sandbox, sandbox_url, run):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run(sandbox_url, code, run_timeout=2)
    assert r["status"] == "Failed"
    assert _wait_no_sandbox_processes(sandbox.proc.pid) == []
    _assert_service_ok(sandbox_url)


def test_process_count_limit_reports_a_clean_error(sandbox_url):
    code = ("import os, time\nn = 0\ntry:\n    for _ in range(1000):\n        if os.fork() == 0:\n"
            "            time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError as exc:\n"
            "    print('limit after', n, exc.errno)\n")
    out = stdout_of(run_code(sandbox_url, code, run_timeout=10))
    assert out.startswith("limit after") and int(out.split()[2]) < 1000


def test_two_gigabyte_allocation_fails_cleanly(sandbox_url):
    r = run_code(sandbox_url, "x = bytearray(2 * 1024**3)\nprint('allocated')", memory_limit_MB=1024)
    assert r["status"] == "Failed" and "MemoryError" in stderr_of(r)
    assert "allocated" not in stdout_of(r)
    _assert_service_ok(sandbox_url)


def test_numpy_inverse_works_under_the_default_memory_limit(sandbox_url):
    r = run_code(sandbox_url, "import numpy\nprint(round(numpy.linalg.inv(numpy.eye(500)).trace()))")
    assert r["status"] == "Success" and stdout_of(r) == "500\n"


def test_numpy_with_threads_starts_under_the_limit(sandbox_url):
    code = ("import threading, numpy\nts = [threading.Thread(target=lambda: numpy.ones(10**6).sum())"
            " for _ in range(8)]\n[t.start() for t in ts]; [t.join() for t in ts]\nprint('ok')")
    assert stdout_of(run_code(sandbox_url, code)) == "ok\n"


def test_output_is_capped_with_a_visible_marker(sandbox_url):
    r = run_code(sandbox_url, "import sys\nprint('A' * 1_000_000)\nsys.stderr.write('E' * 1_000_000)")
    out, err = stdout_of(r), stderr_of(r)
    assert "[output truncated:" in out and "[output truncated:" in err
    assert len(out) < 8192 and len(err) < 8192
    assert r["status"] == "Success"


def test_endless_output_until_timeout_does_not_hurt_the_service(sandbox_url):
    r = run_code(sandbox_url, "while True: print('spam' * 1000)", run_timeout=1)
    assert r["run_result"]["status"] == "TimeLimitExceeded"
    assert "[output truncated:" in stdout_of(r)
    _assert_service_ok(sandbox_url)


def test_no_descriptor_of_the_service_is_inherited(sandbox_url):
    code = "import json, os\nprint(json.dumps(sorted(int(f) for f in os.listdir('/proc/self/fd'))))"
    out = stdout_of(run_code(sandbox_url, code))
    assert json.loads(out) == [0, 1, 2, 3]  # 3 is the listdir handle itself


def test_memory_limit_covers_all_processes_of_a_run(sandbox, sandbox_url):
    """Eight processes of 600 MB each stay below the per-process limit; held at the same time
    they would need 4.8 GB, and the run's cgroup (1024 MB + tmpfs + slack) admits two at most.

    No sleep decides anything: the run waits (with a deadline) until every child has either
    allocated and signalled it (a ``held-PID`` file) or been killed, then counts the holders."""
    health = httpx.get(f"{sandbox_url}/healthz", timeout=10).json()
    assert health["cgroups"] in (1, 2), "this host offers cgroups; the sandbox must use them"
    code = forked_memory_bomb(children=8, mb=600, settle_s=40)
    r = run_code(sandbox_url, code, memory_limit_MB=1024, run_timeout=60)
    verdict = MemoryBombVerdict.parse(stdout_of(r))
    assert verdict.settled, r
    assert 1 <= verdict.holding <= 2, r  # never more than the run's limit resident at once
    assert verdict.allocated >= verdict.holding and verdict.killed >= 6, r
    assert _wait_no_sandbox_processes(sandbox.proc.pid, 10) == []
    _assert_service_ok(sandbox_url)


def test_nothing_network_side_survives_into_later_runs_of_a_slot(sandbox_url):
    """Runs of a slot share its (empty) network namespace, one run at a time: a socket left
    listening by a run's background process must be gone for every later run."""
    code = """
import os, socket, time
if os.fork() == 0:
    s = socket.socket(socket.AF_UNIX)
    s.bind("\\0retool-leak-probe")
    s.listen()
    time.sleep(300)
time.sleep(0.2)
print("bound")
"""
    assert stdout_of(run_code(sandbox_url, code)) == "bound\n"
    probe = ("import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect('\\0retool-leak-probe')\n"
             "    print('LEAK')\nexcept OSError:\n    print('clean')\n")
    outs = [stdout_of(run_code(sandbox_url, probe)) for _ in range(40)]  # cycles through every slot
    assert outs == ["clean\n"] * 40
