"""API contract of the sandbox against a real server on loopback (SandboxFusion shape)."""

from __future__ import annotations

import base64

import httpx
import pytest

from services.sandbox.phases import PHASES
from tests.integration.sandbox_client import run_code, stderr_of, stdout_of

pytestmark = pytest.mark.integration


def test_hello_world_has_the_sandboxfusion_shape(sandbox_url):
    r = run_code(sandbox_url, 'print("Hello, world!")')
    assert set(r) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert r["status"] == "Success" and r["message"] == "" and r["compile_result"] is None
    rr = r["run_result"]
    assert set(rr) == {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert rr["status"] == "Finished" and rr["return_code"] == 0
    assert rr["stdout"] == "Hello, world!\n" and rr["stderr"] == ""
    assert 0 < rr["execution_time"] < 10
    assert r["files"] == {}


def test_verl_style_payload_with_every_field(sandbox_url):
    """The exact payload verl's SandboxFusion tool sends."""
    payload = {"code": "import sys\nprint(sys.stdin.read().upper())", "stdin": "abc",
               "compile_timeout": 10, "run_timeout": 10, "memory_limit_MB": 1024, "language": "python",
               "files": {}, "fetch_files": []}
    r = httpx.post(f"{sandbox_url}/run_code", json=payload, timeout=60).json()
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "ABC\n"


def test_exception_is_failed_with_traceback_and_source_line(sandbox_url):
    r = run_code(sandbox_url, "x = 1\ny = x / 0\n")
    assert r["status"] == "Failed" and r["run_result"]["status"] == "Finished"
    assert r["run_result"]["return_code"] == 1
    err = stderr_of(r)
    assert "ZeroDivisionError" in err and 'line 2' in err and "y = x / 0" in err


def test_syntax_error_and_sys_exit_codes(sandbox_url):
    r = run_code(sandbox_url, "def f(:\n")
    assert r["status"] == "Failed" and "SyntaxError" in stderr_of(r)
    assert run_code(sandbox_url, "import sys; sys.exit(3)")["run_result"]["return_code"] == 3
    assert run_code(sandbox_url, "import sys; sys.exit()")["status"] == "Success"
    r = run_code(sandbox_url, "import sys; sys.exit('bye')")
    assert r["run_result"]["return_code"] == 1 and "bye" in stderr_of(r)


def test_script_semantics_main_argv_and_atexit(sandbox_url):
    code = ("import sys, atexit, threading\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "t = threading.Thread(target=lambda: print('thread ran')); t.start()\n"
            "print(__name__, sys.argv)\n")
    out = stdout_of(run_code(sandbox_url, code))
    assert "__main__ ['main.py']" in out and "atexit ran" in out and "thread ran" in out


def test_timeout_is_time_limit_exceeded(sandbox_url):
    r = run_code(sandbox_url, "import time\nprint('start', flush=True)\ntime.sleep(30)", run_timeout=1)
    assert r["status"] == "Failed" and r["run_result"]["status"] == "TimeLimitExceeded"
    assert "start" in stdout_of(r)
    assert r["run_result"]["execution_time"] <= 1.5


def test_files_in_and_fetch_files_out(sandbox_url):
    files = {"data/in.txt": base64.b64encode(b"21").decode()}
    code = "n = int(open('data/in.txt').read())\nopen('out.txt', 'w').write(str(n * 2))\nprint('ok')"
    r = run_code(sandbox_url, code, files=files, fetch_files=["out.txt", "missing.txt"])
    assert r["status"] == "Success"
    assert base64.b64decode(r["files"]["out.txt"]) == b"42"
    assert "missing.txt" not in r["files"]


def test_fetch_files_does_not_follow_symlinks_out_of_the_workdir(sandbox_url):
    code = "import os\nos.symlink('/etc/passwd', 'leak.txt')\nos.symlink('/etc', 'etcdir')"
    r = run_code(sandbox_url, code, fetch_files=["leak.txt", "etcdir/passwd"])
    assert r["status"] == "Success" and r["files"] == {}


@pytest.mark.parametrize("body,field", [
    ({"language": "python"}, "code"),
    ({"code": "1", "language": "cpp"}, "language"),
    ({"code": "1", "run_timeout": -1}, "run_timeout"),
    ({"code": "1", "compile_timeout": -1}, "compile_timeout"),
    ({"code": "1", "files": {"../x": ""}}, "files"),
    ({"code": "1", "files": {"/etc/x": ""}}, "files"),
    ({"code": "1", "files": {"a.txt": "@@@"}}, "files"),
    ({"code": "1", "fetch_files": "out.txt"}, "fetch_files"),
    ({"code": 5}, "code"),
])
def test_requests_that_cannot_mean_anything_are_422_naming_the_field(sandbox_url, body, field):
    r = httpx.post(f"{sandbox_url}/run_code", json=body, timeout=30)
    assert r.status_code == 422, r.text
    locs = [d["loc"] for d in r.json()["detail"]]
    assert any(field in loc for loc in locs), locs


def test_not_json_is_422(sandbox_url):
    r = httpx.post(f"{sandbox_url}/run_code", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_healthz_and_metrics(sandbox_url):
    run_code(sandbox_url, "print(1)")
    h = httpx.get(f"{sandbox_url}/healthz").json()
    assert h["status"] == "ok" and h["zygotes_alive"] >= 1
    text = httpx.get(f"{sandbox_url}/metrics").text
    for name in ("sandbox_requests_total", "sandbox_execution_seconds_bucket", "sandbox_executions_in_flight",
                 "sandbox_queue_depth", "sandbox_rejections_total"):
        assert name in text
    assert 'sandbox_requests_total{status="Success"}' in text
    # where a run's CPU goes, by step (bench/sandbox.py reads these): every step counted, none negative
    phases = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("sandbox_run_phase_cpu_seconds_total{")}
    assert set(phases) == set(PHASES)
    assert all(v >= 0 for v in phases.values()) and phases["fork"] > 0 and phases["exit"] > 0, phases
    runs = next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("sandbox_run_phase_runs_total "))
    assert runs >= 1


def test_warm_modules_are_preloaded_but_state_does_not_leak(sandbox_url):
    first = run_code(sandbox_url, "import sys, sympy\nsympy.LEAK = 1\nprint('sympy' in sys.modules)")
    assert stdout_of(first) == "True\n"
    second = run_code(sandbox_url, "import sympy\nprint(hasattr(sympy, 'LEAK'))")
    assert stdout_of(second) == "False\n"


def test_numpy_random_state_differs_between_runs(sandbox_url):
    outs = {stdout_of(run_code(sandbox_url, "import numpy as np; print(np.random.rand())")) for _ in range(3)}
    assert len(outs) == 3
