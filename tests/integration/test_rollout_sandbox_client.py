"""The rollout's sandbox client against the real sandbox service: what the model gets to see."""

from __future__ import annotations

import pytest

from services.rollout.agent.sandbox import SandboxClient

pytestmark = pytest.mark.integration


async def test_outputs_errors_and_timeouts_as_interpreter_text(sandbox_url: str) -> None:
    client = SandboxClient(sandbox_url, run_timeout_s=1.0)
    try:
        ok = await client.run("import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 4, x))")
        assert (ok.text, ok.error) == ("[-2, 2]", False) and ok.latency_s > 0
        both = await client.run("import sys\nprint('out')\nprint('warn', file=sys.stderr)")
        assert both.text == "out\nwarn" and not both.error
        exc = await client.run("def f():\n    return 1/0\nf()")
        assert exc.error and "ZeroDivisionError: division by zero" in exc.text and "Traceback" in exc.text
        slow = await client.run("print('started', flush=True)\nwhile True:\n    pass")
        assert slow.error and "exceeded 1 seconds" in slow.text
        exit_code = await client.run("import sys\nsys.exit(3)")
        assert exit_code.error and "exited with code 3" in exit_code.text
        silent = await client.run("x = 1")
        assert (silent.text, silent.error) == ("", False)
    finally:
        await client.aclose()
