"""The recovery demo's SFT traces show exactly what the real sandbox returns and the rollout agent
shows the model: the bare call's NameError traceback, and the fixed call's value."""

from __future__ import annotations

import httpx
import pytest

from services.chat.tool_result import format_run_result
from services.demo.recovery_task import Problem, bare_code, fixed_code, interpreter_text
from services.transport.sandbox.schemas import RunCodeResponse


@pytest.mark.parametrize("p", [Problem(fn="comb", args=(12, 5)), Problem(fn="gcd", args=(84, 36)),
                               Problem(fn="isqrt", args=(12345,))], ids=lambda p: p.fn)
def test_trace_interpreter_texts_are_the_sandboxes(sandbox_url: str, p: Problem) -> None:
    for code, fixed in ((bare_code(p), False), (fixed_code(p), True)):
        r = httpx.post(f"{sandbox_url}/run_code", json={"code": code, "language": "python"}, timeout=60)
        shown = format_run_result(RunCodeResponse.model_validate(r.json()), 10.0)
        assert shown.error is not fixed
        assert shown.text == interpreter_text(p, fixed)
    assert f"NameError: name '{p.fn}' is not defined" in interpreter_text(p, False)
