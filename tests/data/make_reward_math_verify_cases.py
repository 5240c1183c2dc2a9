"""Writes tests/data/reward_math_verify_cases.jsonl: Math-Verify's own parametrized test cases, as data.

Source: the public repository huggingface/Math-Verify at the commit in ``SOURCE_COMMIT`` (its
licence, beside the data as ``reward_math_verify_LICENCE``; ``tests/test_all.py`` carries an MIT
header of the same copyright holder). Only the (gold, pred, expected) rows of its
``pytest.mark.parametrize`` decorators and the settings each test passes to its
``compare_strings`` helper are kept; no code of it is stored here.

The test files are read with ``ast`` and never run or evaluated: a row is a literal, or one of
the few expressions the files use to build a literal (``math.sqrt(17)``, an f-string of it with
a constant format spec), which ``_value`` computes itself; anything else stops the script with
the expression named.

Run: ``python tests/data/make_reward_math_verify_cases.py PATH/TO/Math-Verify/tests``.
"""

from __future__ import annotations

import ast
import json
import math
import sys
from pathlib import Path
from typing import Any

SOURCE_REPO = "huggingface/Math-Verify"
SOURCE_COMMIT = "5d148cfaaf99214c2e4ffb4bc497ab042c592a7a"
OUT = Path(__file__).with_name("reward_math_verify_cases.jsonl")
_MATH_FUNCS = {"sqrt": math.sqrt}


def _value(node: ast.expr) -> Any:  # noqa: ANN401 - any literal of a test file
    """A literal's value, or a whitelisted ``math.f(literal)`` / f-string of one."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "math"
        and node.func.attr in _MATH_FUNCS
        and not node.keywords
    ):
        return _MATH_FUNCS[node.func.attr](*(_value(a) for a in node.args))
    if isinstance(node, ast.JoinedStr):
        parts = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                parts.append(str(part.value))
            elif isinstance(part, ast.FormattedValue) and part.conversion == -1:
                spec = "" if part.format_spec is None else _value(part.format_spec)
                parts.append(format(_value(part.value), spec))
            else:
                raise ValueError(f"unsupported f-string part: {ast.unparse(part)}")
        return "".join(parts)
    if isinstance(node, (ast.Tuple, ast.List)):
        return [_value(e) for e in node.elts]
    raise ValueError(f"not a literal: {ast.unparse(node)}")


def _settings(fn: ast.FunctionDef, row: dict[str, Any]) -> dict[str, Any] | None:
    """The settings the test passes to ``compare_strings``; None when it calls parse/verify itself."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "compare_strings":
            out: dict[str, Any] = {"match_types": ["latex", "expr"]}
            for kw in node.keywords:
                out[kw.arg or ""] = row[kw.value.id] if isinstance(kw.value, ast.Name) else _value(kw.value)
            return out
    return None


def cases(tests_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(tests_dir.glob("test_*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for dec in fn.decorator_list:
                if not (isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize"):
                    continue
                names = [n.strip() for n in _value(dec.args[0]).split(",")]
                if "gold" not in names or "pred" not in names:
                    continue
                for elt in dec.args[1].elts:  # type: ignore[attr-defined]
                    row = dict(zip(names, _value(elt), strict=True))
                    out.append({
                        "source": f"{SOURCE_REPO}@{SOURCE_COMMIT}:tests/{path.name}::{fn.name}",
                        "gold": row["gold"],
                        "pred": row["pred"],
                        "expected": bool(row.get("expected", row.get("result"))),
                        "settings": _settings(fn, row),
                    })
    return out


def main() -> None:
    rows = cases(Path(sys.argv[1]))
    with OUT.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} cases -> {OUT}")


if __name__ == "__main__":
    main()
