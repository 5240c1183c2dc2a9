"""The package picture stays true: which ``services`` packages may import which.

Layers, bottom up (a package may import its own layer's shared packages and anything below):
1. ``common``, ``proto_gen``: import no other ``services`` package (``common`` may use the generated
   gRPC code);
2. ``transport`` (wire contracts and clients), ``chat`` (token layout), ``data`` (dataset files):
   import only layer 1, except that ``chat`` may import ``transport`` (a tool result is rendered
   from the sandbox's typed answer; ``transport`` never imports ``chat``);
3. the services ``sandbox``, ``reward``, ``rollout``, ``trainer``: import layers 1-2, never each other;
4. orchestration (``stack``, ``eval``, ``demo``, ``cli``, ``model_cli``, ``models``): anything. ``models``
   (the tiny-model factory) is here because only orchestration, benchmarks and tests build models
   with it: no service may import it (the rollout and the trainer load the directory they are given).
Every import counts: top-level, inside functions and under ``TYPE_CHECKING``. An import inside a
function is the exception, kept only where it is heavy or optional, and says why with a ``# lazy:``
comment between its function's ``def`` and the import itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services"
BASE = {"common", "proto_gen"}
SHARED = {"transport", "chat", "data"}
SERVICES = {"sandbox", "reward", "rollout", "trainer"}
ORCHESTRATION = {"stack", "eval", "demo", "cli", "model_cli", "models"}

ALLOWED: dict[str, set[str]] = {
    "proto_gen": set(),
    "common": {"proto_gen"},
    **{p: BASE for p in SHARED},
    "chat": BASE | {"transport"},
    **{p: BASE | SHARED for p in SERVICES},
}


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def imported_packages(path: Path, own: str) -> set[str]:
    """The top-level ``services`` packages that the module at ``path`` imports (relative imports
    count as its own package ``own``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names = ["services." + own]
            elif node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "services" and len(parts) > 1:
                found.add(parts[1])
    return found


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "proto_gen" not in p.parts or p.name == "__init__.py")


def test_every_package_has_a_layer() -> None:
    packages = {_package(p) for p in _modules()} - {"__init__"}
    unknown = packages - BASE - SHARED - SERVICES - ORCHESTRATION
    assert not unknown, f"new services packages {sorted(unknown)}: give them a layer in this test"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layers(path: Path) -> None:
    own = _package(path)
    if own in ORCHESTRATION or own == "__init__":
        return
    bad = imported_packages(path, own) - ALLOWED[own] - {own}
    assert not bad, f"services/{path.relative_to(ROOT)} ({own}) imports services.{sorted(bad)}"


def test_no_service_imports_the_model_factory() -> None:
    """``services.models`` is orchestration: a service importing it would fail the layer test above."""
    assert "models" not in set().union(*ALLOWED.values())


def test_the_checker_sees_function_local_and_type_checking_imports(tmp_path: Path) -> None:
    """The test above can fail: an import hidden in a function or under TYPE_CHECKING is found."""
    module = tmp_path / "probe.py"
    module.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from services.rollout import config\n"
                      "def f():\n    import services.reward.app\n    from . import x\n")
    assert imported_packages(module, "trainer") == {"rollout", "reward", "trainer"}


LAZY_REASON = re.compile(r"#\s*lazy:")


def unexplained_function_imports(path: Path) -> list[str]:
    """``file:line`` of each import inside a function with no ``# lazy:`` comment between the
    function's ``def`` line and the import."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), filename=str(path))
    bad: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import | ast.ImportFrom):
                span = lines[fn.lineno - 1:node.end_lineno]
                if not any(LAZY_REASON.search(line) for line in span):
                    bad.add(f"{path}:{node.lineno}")
    return sorted(bad)


def test_function_level_imports_say_why() -> None:
    bad = [b for p in _modules() if "proto_gen" not in p.parts for b in unexplained_function_imports(p)]
    assert not bad, ("imports inside functions without a '# lazy: <why>' comment (lift them to the top of "
                     f"the file, or say why they are heavy or optional): {bad}")


def test_the_lazy_check_finds_an_unexplained_import(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    # lazy: heavy\n    import json\n"
                      "def g():\n    # a comment that gives no reason\n    import os\n")
    assert unexplained_function_imports(module) == [f"{module}:6"]
