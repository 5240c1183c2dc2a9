import pytest

from services.sandbox.routing import imported_modules, runs_on_light

LIGHT = frozenset({"math", "fractions", "itertools", "collections"})


def test_imported_modules_forms():
    code = ("import math, numpy as np\nfrom sympy.abc import x\n    import os.path\n"
            "from fractions import Fraction  # comment\nimport a.b.c as d; print(1)\n")
    assert imported_modules(code) == {"math", "numpy", "sympy", "os", "fractions", "a"}


@pytest.mark.parametrize("code,light", [
    ('print("Hello, world!")', True),
    ("import math\nprint(math.comb(10, 3))", True),
    ("from fractions import Fraction\nimport itertools", True),
    ("import sympy as sp", False),
    ("import numpy\n", False),
    ("def f():\n    import scipy\n", False),
    ("m = __import__('sympy')", False),
    ("import importlib; importlib.import_module('numpy')", False),
    ("exec('import numpy')", False),
])
def test_routing(code, light):
    assert runs_on_light(code, LIGHT) is light
