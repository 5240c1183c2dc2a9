"""Choose the zygote pool for a piece of code from the modules it imports.

Forking a zygote costs time proportional to its heap, so the pools are ordered from the
cheapest (standard library only: most tool calls are arithmetic, loops, itertools) to the
dearest (numpy, sympy, scipy, pandas, networkx all warm), and code runs on the first pool
whose warm modules cover every warm-able module it imports; code that also imports a
module warm nowhere (it may pull in numpy) runs at least on the default pool. Invariant:
the choice only affects speed, never results — a module a pool lacks is simply imported
at run time. Code that imports dynamically (``__import__``, ``importlib``,
``exec``/``eval``) goes to the last pool, which holds the most.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([A-Za-z_][\w.]*)[ \t]+import|import[ \t]+([^\n#;]+))", re.M)
_DYNAMIC = re.compile(r"__import__|importlib|\bexec\s*\(|\beval\s*\(")
# importing these needs nothing beyond a bare interpreter (built in or tiny)
_CHEAP = frozenset({"sys", "os", "time", "typing", "dataclasses", "copy", "abc", "enum", "array",
                    "struct", "io", "builtins", "string", "gc", "itertools", "math", "cmath"})


def imported_modules(code: str) -> set[str]:
    names: set[str] = set()
    for from_mod, import_list in _IMPORT.findall(code):
        if from_mod:
            names.add(from_mod.split(".")[0])
            continue
        for part in import_list.split(","):
            token = part.strip().split(" ")[0]
            if token:
                names.add(token.split(".")[0])
    return names


def top_level(modules: Iterable[str]) -> frozenset[str]:
    return frozenset(m.split(".")[0] for m in modules)


def choose_pool(code: str, pools: Sequence[frozenset[str]], default: int) -> int:
    """Index of the pool (cheapest first, by their warm top-level modules) to run ``code`` on."""
    last = len(pools) - 1
    if _DYNAMIC.search(code):
        return last
    warm_somewhere = frozenset().union(*pools)
    imports = imported_modules(code) - _CHEAP
    needed = imports & warm_somewhere
    best = next((i for i, warm in enumerate(pools) if needed <= warm), last)
    return max(best, default) if imports - warm_somewhere else best
