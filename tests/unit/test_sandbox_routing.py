import pytest

from services.sandbox.routing import choose_pool, imported_modules, top_level

LIGHT = frozenset({"math", "fractions", "itertools", "collections"})
FULL = LIGHT | {"numpy", "sympy", "mpmath"}
HEAVY = FULL | top_level(["scipy.optimize", "pandas", "networkx"])
POOLS = [LIGHT, FULL, HEAVY]


def test_imported_modules_forms():
    code = ("import math, numpy as np\nfrom sympy.abc import x\n    import os.path\n"
            "from fractions import Fraction  # comment\nimport a.b.c as d; print(1)\n")
    assert imported_modules(code) == {"math", "numpy", "sympy", "os", "fractions", "a"}


@pytest.mark.parametrize("code,pool", [
    ('print("Hello, world!")', 0),
    ("import math\nprint(math.comb(10, 3))", 0),
    ("from fractions import Fraction\nimport itertools", 0),
    ("import sys, os, time", 0),
    ("import sympy as sp", 1),
    ("import numpy\n", 1),
    ("from mpmath import mp", 1),
    ("def f():\n    import scipy.optimize\n", 2),
    ("import pandas as pd, numpy as np", 2),
    ("import networkx", 2),
    ("import numpy, some_unknown_module", 1),
    ("import some_unknown_module", 1),  # warm nowhere: it may pull numpy in, so not the light pool
    ("import pandas, some_unknown_module", 2),
    ("m = __import__('sympy')", 2),
    ("import importlib; importlib.import_module('numpy')", 2),
    ("exec('import numpy')", 2),
])
def test_routing_picks_the_cheapest_pool_covering_the_imports(code, pool):
    assert choose_pool(code, POOLS, default=1) == pool


def test_routing_without_a_heavy_pool_falls_back_to_the_largest():
    assert choose_pool("import scipy", [LIGHT, FULL], default=1) == 1
    assert choose_pool("import numpy", [FULL], default=0) == 0
