"""The fast path: exact rational values of plain numeric answers, in pure Python.

Integers, decimals, ``a/b``, ``\\frac{a}{b}`` (also ``\\frac12``), a sign, and scientific
notation (``1.5e3``, ``1.5\\times10^{3}``) become a ``Fraction``; anything else returns
None and is left to the symbolic path. Most DAPO-Math-17k and all AIME ground truths are
integers, so most grades never leave this module. Exponents are bounded: no big powers.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUM = r"[+-]?(?:\d+\.?\d*|\.\d+)"
_PLAIN = re.compile(rf"^{_NUM}$")
_SLASH = re.compile(rf"^({_NUM})/({_NUM})$")
_FRAC = re.compile(r"^([+-]?)\\frac(?:\{([+-]?\d+)\}|(\d))(?:\{([+-]?\d+)\}|(\d))$")
_SCI = re.compile(rf"^({_NUM})(?:[eE]([+-]?\d+)|(?:\\times|\\cdot|\*|x)10\^\{{?([+-]?\d+)\}}?)$")
MAX_EXPONENT = 400


def to_fraction(s: str) -> Fraction | None:
    try:
        if _PLAIN.match(s):
            return Fraction(s)
        m = _SLASH.match(s)
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den else None
        m = _FRAC.match(s)
        if m:
            num = int(m.group(2) or m.group(3))
            den = int(m.group(4) or m.group(5))
            if den == 0:
                return None
            value = Fraction(num, den)
            return -value if m.group(1) == "-" else value
        m = _SCI.match(s)
        if m:
            exp = int(m.group(2) or m.group(3))
            if abs(exp) > MAX_EXPONENT:
                return None
            return Fraction(m.group(1)) * Fraction(10) ** exp
    except (ValueError, ZeroDivisionError):
        return None
    return None
