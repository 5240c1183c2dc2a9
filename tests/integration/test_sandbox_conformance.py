"""Conformance with the clients users bring unchanged: verl's SandboxFusion tool / reward
utilities and SandboxFusion's own Python client, against a real service with the default
limits (the deployment's configuration, not the test fixture's smaller caps).

The client logic below is written by us from their documented behaviour (no code of theirs):
- verl ``call_sandbox_api``: POSTs ``{compile_timeout, run_timeout, code, stdin,
  memory_limit_MB, language, files: {}, fetch_files: []}`` with a read timeout of
  ``compile_timeout + run_timeout + 10`` s; retries only HTTP 504, 3 attempts, sleeping
  1 s then 2 s; any other non-2xx or transport error fails the call at once;
- verl ``_process_single_case`` classifies: ``SandboxError`` -> -1; ``Failed`` with
  ``TimeLimitExceeded`` -> -3 (timeout); ``Failed`` with ``Error`` or ``Finished`` and a
  non-zero ``return_code`` -> -2 (runtime error); ``Success`` + ``Finished`` -> ran;
- verl's tool shows ``stdout + stderr`` when ``run_status == "Finished"``, else
  ``"no stdout here"``;
- SandboxFusion's client parses the response into its models (the fields below, nothing
  else) and retries any non-200 answer and any ``SandboxError``.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from services.common.retry import RETRY_STATUS
from services.sandbox.launcher import SandboxProcess
from tests.integration.sandbox_client import kill_runs_of

pytestmark = pytest.mark.integration

VERL_MAX_RETRIES, VERL_API_TIMEOUT = 3, 10


class SFCommandRunResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class SFRunCodeResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: SFCommandRunResult | None = None
    run_result: SFCommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


def verl_call_sandbox_api(url: str, code: str, *, stdin: str | None = None, compile_timeout: float = 30,
                          run_timeout: float = 30, memory_limit_mb: int = 1024, language: str = "python",
                          on_retry: Callable[[int], None] = lambda attempt: None,
                          ) -> tuple[dict[str, Any] | None, str | None, list[int]]:
    """(response json, error, HTTP statuses seen), retrying as verl does."""
    payload = {"compile_timeout": compile_timeout, "run_timeout": run_timeout, "code": code, "stdin": stdin,
               "memory_limit_MB": memory_limit_mb, "language": language, "files": {}, "fetch_files": []}
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    seen: list[int] = []
    error = None
    for attempt in range(VERL_MAX_RETRIES):
        try:
            r = httpx.post(f"{url}/run_code", json=payload, headers=headers,
                           timeout=compile_timeout + run_timeout + VERL_API_TIMEOUT)
        except httpx.HTTPError as exc:
            return None, f"API Request Error: {exc}", seen
        seen.append(r.status_code)
        if r.status_code == 504:
            error = f"Gateway Timeout (504) on attempt {attempt + 1}/{VERL_MAX_RETRIES}"
            if attempt < VERL_MAX_RETRIES - 1:
                on_retry(attempt)
                time.sleep(attempt + 1)
            continue
        if r.status_code >= 400:
            return None, f"API Request Error: {r.status_code}", seen
        return r.json(), None, seen
    return None, error, seen


def verl_classify(resp: dict[str, Any]) -> int | str:
    run = resp.get("run_result") or {}
    if resp["status"] == "SandboxError":
        return -1
    if resp["status"] == "Failed":
        if run.get("status") == "TimeLimitExceeded":
            return -3
        if run.get("status") == "Error" or (run.get("status") == "Finished" and run.get("return_code") != 0):
            return -2
        return -1
    return "ran" if run.get("status") == "Finished" else -1


def verl_tool_text(resp: dict[str, Any]) -> str:
    run = resp.get("run_result") or {}
    return run["stdout"] + run["stderr"] if run.get("status") == "Finished" else "no stdout here"


@pytest.fixture(scope="module")
def default_sandbox(tmp_path_factory) -> Iterator[SandboxProcess]:
    log = tmp_path_factory.mktemp("conformance") / "sandbox.log"
    args = ["--set", "max_concurrency=4", "--set", "zygotes=1", "--set", "light_zygotes=1",
            "--set", "heavy_zygotes=0"]
    with SandboxProcess(args, log_path=str(log)) as proc:
        yield proc


def test_verl_payload_and_response_shape(default_sandbox):
    resp, error, seen = verl_call_sandbox_api(default_sandbox.url, "print('Hello, world!')")
    assert error is None and seen == [200]
    parsed = SFRunCodeResponse.model_validate(resp)  # SandboxFusion's client model, strictly
    assert parsed.status == "Success" and parsed.message == "" and parsed.compile_result is None
    assert parsed.run_result is not None and parsed.run_result.return_code == 0
    assert verl_classify(resp) == "ran" and verl_tool_text(resp) == "Hello, world!\n"
    with_stdin, _, _ = verl_call_sandbox_api(default_sandbox.url, "print(int(input()) * 2)", stdin="21")
    assert verl_tool_text(with_stdin) == "42\n"


def test_verl_error_codes_for_failures_and_timeouts(default_sandbox):
    url = default_sandbox.url
    runtime_error, _, _ = verl_call_sandbox_api(url, "def f():\n    return 1 / 0\nf()")
    assert verl_classify(runtime_error) == -2
    text = verl_tool_text(runtime_error)  # the tool shows the traceback to the model
    assert text.startswith("Traceback") and "ZeroDivisionError: division by zero" in text
    exit_code, _, _ = verl_call_sandbox_api(url, "import sys\nsys.exit(3)")
    assert verl_classify(exit_code) == -2 and exit_code["run_result"]["return_code"] == 3
    killed, _, _ = verl_call_sandbox_api(url, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert verl_classify(killed) == -2 and killed["run_result"]["return_code"] == -9
    timeout, _, _ = verl_call_sandbox_api(url, "import time\nprint('start', flush=True)\ntime.sleep(30)",
                                          compile_timeout=1, run_timeout=1)
    assert verl_classify(timeout) == -3 and verl_tool_text(timeout) == "no stdout here"
    run = SFRunCodeResponse.model_validate(timeout).run_result
    assert run is not None and run.status == "TimeLimitExceeded" and run.return_code is None
    assert run.stdout == "start\n" and 1 <= run.execution_time < 2


def test_sandboxfusion_python_cases(default_sandbox):
    """SandboxFusion's own ``/run_code`` Python cases, as its client sends them."""
    url = default_sandbox.url

    def post(**body: Any) -> SFRunCodeResponse:
        r = httpx.post(f"{url}/run_code", json={"language": "python", **body}, timeout=60)
        assert r.status_code == 200, r.text
        return SFRunCodeResponse.model_validate(r.json())

    r = post(code="print(123)", run_timeout=5)
    assert r.status == "Success" and r.run_result.stdout.strip() == "123"
    r = post(code="import time; time.sleep(0.5)", run_timeout=0.1)
    assert r.status == "Failed" and r.run_result.status == "TimeLimitExceeded"
    r = post(code="assert 1 == 2", run_timeout=5)
    assert r.status == "Failed" and r.run_result.status == "Finished"
    assert "AssertionError" in r.run_result.stderr
    r = post(code="int a = 1", run_timeout=5)
    assert r.status == "Failed" and "SyntaxError: invalid syntax" in r.run_result.stderr
    r = post(code='print(open("dir1/dir2/dir3/secret_flag").read())', run_timeout=5,
             files={"dir1/dir2/dir3/secret_flag": base64.b64encode(b"hello, this is a test").decode()})
    assert r.status == "Success" and "hello, this is a test" in r.run_result.stdout
    r = post(code="print(int(input()))", run_timeout=5, stdin="65535")
    assert r.status == "Success" and r.run_result.stdout == "65535\n"
    # theirs writes /mnt/b; here only the run's /tmp is writable, so an absolute path lives there
    r = post(code='open("a.txt", "w").write("secret"); open("/tmp/b", "w").write("sauce")', run_timeout=5,
             fetch_files=["a.txt", "/tmp/b", "/mnt/b", "../../etc/passwd"])
    assert r.status == "Success"
    assert base64.b64decode(r.files["a.txt"]) == b"secret" and base64.b64decode(r.files["/tmp/b"]) == b"sauce"
    assert set(r.files) == {"a.txt", "/tmp/b"}  # each bad entry skipped on its own, and said so
    assert "'/mnt/b' skipped" in r.message and "'../../etc/passwd' skipped" in r.message


def test_over_limit_values_are_clamped_and_said_so(default_sandbox):
    r = httpx.post(f"{default_sandbox.url}/run_code", timeout=60, json={
        "code": "import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU)[0])", "language": "python",
        "run_timeout": 1000, "memory_limit_MB": 100_000})
    assert r.status_code == 200
    body = SFRunCodeResponse.model_validate(r.json())
    assert body.status == "Success" and body.run_result.stdout == "61\n"  # the 60 s maximum (+1 s CPU)
    assert "run_timeout 1000 s clamped to the maximum 60 s" in body.message
    assert "memory_limit_MB 100000 clamped to the maximum 4096" in body.message
    assert r.headers["x-sandbox-notes"] == body.message


def test_output_cap_is_sandboxfusions_1_mb_by_default(default_sandbox):
    r = httpx.post(f"{default_sandbox.url}/run_code", timeout=60, json={
        "code": "import sys\nsys.stdout.write('A' * 3_000_000)\nprint('é' * 600_000, file=sys.stderr)",
        "language": "python"}).json()
    out, err = r["run_result"]["stdout"], r["run_result"]["stderr"]
    for stream in (out, err):
        assert "[output truncated:" in stream and 1024 * 1024 - 4 <= len(stream.encode()) < 1024 * 1024 + 100
    assert out.startswith("A" * 1000) and err.rstrip("\n").endswith("é" * 1000)


def test_a_busy_sandbox_answers_504_which_verls_client_retries(tmp_path):
    """Back-pressure the clients in use handle: wait for a slot up to a deadline, then 504."""
    args = ["--set", "max_concurrency=1", "--set", "zygotes=1", "--set", "light_zygotes=0",
            "--set", "heavy_zygotes=0", "--set", "queue_timeout_s=0.5", "--set", "max_queue=1"]
    with SandboxProcess(args, log_path=str(tmp_path / "sb.log")) as sb, httpx.Client(timeout=120) as client:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            busy = pool.submit(client.post, f"{sb.url}/run_code", json={
                "code": "import time\ntime.sleep(50)", "language": "python", "run_timeout": 55})
            deadline = time.monotonic() + 60
            while client.get(f"{sb.url}/healthz").json()["in_flight"] < 1:
                assert time.monotonic() < deadline and not busy.done()
                time.sleep(0.05)
            start = time.monotonic()
            plain = client.post(f"{sb.url}/run_code", json={"code": "print(1)", "language": "python"})
            assert plain.status_code == 504 and plain.headers["retry-after"] == "1"
            assert "retry later" in plain.json()["detail"] and time.monotonic() - start < 30
            assert 504 in RETRY_STATUS  # the rollout's own client retries it as well

            def load_goes_away(attempt: int) -> None:  # the busy run ends while verl waits to retry
                assert kill_runs_of(sb.proc.pid) >= 1
                busy.result(timeout=60)

            resp, error, seen = verl_call_sandbox_api(sb.url, "print('after retry')", on_retry=load_goes_away)
            assert error is None and seen == [504, 200], (seen, error)
            assert verl_tool_text(resp) == "after retry\n"
            assert busy.result().json()["run_result"]["return_code"] == -9
        metrics = client.get(f"{sb.url}/metrics").text
        assert 'sandbox_rejections_total{reason="queue_timeout"} 2.0' in metrics
