"""Tool-call parsing (code tags, fences, hermes JSON) and interpreter-text formatting."""

from __future__ import annotations

import json

import pytest

from services.chat.format import truncate_middle
from services.chat.tool_result import format_run_result
from services.chat.toolcall import parse_code_call, parse_hermes_call
from services.transport.sandbox.schemas import RunCodeResponse


def test_code_tag_plain_and_fenced() -> None:
    assert parse_code_call("Let me compute.\n<code>print(1+1)</code>").code == "print(1+1)"
    fenced = "think <code>\n```python\nx = 3\nprint(x**2)\n```\n</code>\n"
    assert parse_code_call(fenced).code == "x = 3\nprint(x**2)"
    # the last <code> before </code> wins (earlier prose may mention the tag)
    assert parse_code_call("I will use <code> tags. <code>print(2)</code>").code == "print(2)"
    # an unclosed fence inside the tags still yields the code
    assert parse_code_call("<code>```py\nprint(3)\n</code>").code == "print(3)"


def test_code_tag_errors_are_messages() -> None:
    assert "empty" in parse_code_call("<code>  </code>").error
    assert "opening <code>" in parse_code_call("print(1)</code>").error
    # a fenced block without the opening tag is accepted
    assert parse_code_call("```python\nprint(5)\n```\n</code>").code == "print(5)"


def test_hermes_valid_call() -> None:
    call = {"name": "code_interpreter", "arguments": {"code": "import math\nprint(math.pi)"}}
    res = parse_hermes_call(f"ok <tool_call>\n{json.dumps(call)}\n</tool_call>")
    assert res.error is None and res.code == "import math\nprint(math.pi)"
    # arguments given as a JSON string (OpenAI style)
    call2 = {"name": "code_interpreter", "arguments": json.dumps({"code": "print(7)"})}
    assert parse_hermes_call(f"<tool_call>{json.dumps(call2)}</tool_call>").code == "print(7)"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (r'{"name": "code_interpreter", "arguments": {"code": "print(\sqrt(2))"}}', "Invalid \\escape"),
        ('{"name": "code_interpreter", "arguments": {"code": "print(1)"}', "Failed to decode tool call"),
        ('{"name": "python", "arguments": {"code": "print(1)"}}', "Unknown tool 'python'"),
        ('{"name": "code_interpreter", "arguments": {"src": "print(1)"}}', "arguments.code"),
        ('["code_interpreter"]', "expected a JSON object"),
        ('{"name": "code_interpreter", "arguments": "{bad"}', "Failed to decode tool call arguments"),
    ],
)
def test_hermes_malformed_calls_become_error_text(body: str, needle: str) -> None:
    res = parse_hermes_call(f"<tool_call>{body}</tool_call>")
    assert res.code is None and needle in res.error


def test_truncate_middle_keeps_head_and_tail_within_limit() -> None:
    text = "HEAD" + "x" * 5000 + "TAIL"
    out = truncate_middle(text, 200)
    assert len(out) <= 200 and out.startswith("HEAD") and out.endswith("TAIL") and "truncated" in out
    assert truncate_middle("short", 200) == "short"


def _resp(
    status: str = "Success",
    run_status: str = "Finished",
    rc: int = 0,
    stdout: str = "",
    stderr: str = "",
    message: str = "",
) -> RunCodeResponse:
    return RunCodeResponse.model_validate({
        "status": status,
        "message": message,
        "compile_result": None,
        "run_result": {
            "status": run_status,
            "execution_time": 0.01,
            "return_code": rc,
            "stdout": stdout,
            "stderr": stderr,
        },
        "executor_pod_name": None,
        "files": {},
    })


def test_format_run_result_cases() -> None:
    ok = format_run_result(_resp(stdout="4\n"), 10)
    assert (ok.text, ok.error) == ("4", False)
    err = format_run_result(_resp("Failed", rc=1, stderr="Traceback...\nZeroDivisionError: x\n"), 10)
    assert err.error and "ZeroDivisionError" in err.text
    tle = format_run_result(_resp("Failed", "TimeLimitExceeded", rc=-9, stdout="partial\n"), 5)
    assert tle.error and tle.text.startswith("partial") and "exceeded 5 seconds" in tle.text
    sbx = format_run_result(RunCodeResponse.model_validate(
        {"status": "SandboxError", "message": "pool exhausted", "run_result": None}), 5)
    assert sbx.error and "pool exhausted" in sbx.text
