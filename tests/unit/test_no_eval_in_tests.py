"""The test runner never evaluates text: output of code run in the sandbox under test is hostile
(issue 33, 5e), so tests parse it as JSON (or ``ast.literal_eval``), never ``eval``/``exec``.

The one exception runs our own test source (``ALLOWED``), named with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ALLOWED = {
    # runs the session worker's statement splitter on literal test source, in-process
    "unit/test_sandbox_session_units.py",
}


def _eval_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec")]


def test_no_test_evaluates_text_with_eval_or_exec():
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel not in ALLOWED and (lines := _eval_calls(path)):
            found[rel] = lines
    assert not found, f"eval/exec in the test runner (parse with json or ast.literal_eval): {found}"


def test_the_check_sees_an_eval_call(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("out = '[1]'\nvalue = eval(out)\n")
    assert _eval_calls(planted) == [2]
