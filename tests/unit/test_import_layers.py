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
Every import counts: top-level, inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
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
