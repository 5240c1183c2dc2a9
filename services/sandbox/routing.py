"""Choose the zygote pool for a piece of code from the modules it imports.

Forking a zygote costs time proportional to its heap, so plain-Python code (most tool
calls: arithmetic, loops, itertools) runs on a light zygote with only the standard
library warm, and code that imports anything else runs on the full one (numpy, sympy, …
warm). Invariant: the choice only affects speed, never results — a module the light
zygote lacks is simply imported at run time. Code that imports dynamically
(``__import__``, ``importlib``) goes to the full pool.
"""

from __future__ import annotations

import re

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


def runs_on_light(code: str, light_modules: frozenset[str]) -> bool:
    if _DYNAMIC.search(code):
        return False
    return imported_modules(code) <= (light_modules | _CHEAP)
