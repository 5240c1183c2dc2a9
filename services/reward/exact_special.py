"""Exact values of ``\\sqrt{n}``, ``k\\sqrt{n}``, ``\\log_b a`` and ``\\ln a`` with integer arguments.

Pure integer arithmetic, no sympy: ``\\sqrt{n}`` is rational iff ``n`` is a perfect square;
``\\log_b a`` (integers ``a > 0``, ``b > 1``) is rational iff ``a`` and ``b`` are powers of one
integer ``r`` (``a = r^m``, ``b = r^n`` → ``m/n``); ``\\ln a`` is rational only for ``a = 1``.
``value`` returns the exact ``Fraction``, ``IRRATIONAL`` when the value is provably
irrational (so it equals no rational answer), or None when the form is not recognised.

``pi_coefficient`` reads rational multiples of π (``2\\pi``, ``\\frac{3\\pi}{2}``, ``3\\pi/2``,
``\\frac{\\pi}{4}``, ``\\pi\\cdot 2``): π is transcendental, so ``aπ = bπ`` iff ``a = b`` and
``aπ`` (a ≠ 0) equals no rational number (``3.14 ≠ π``).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Final

IRRATIONAL: Final = "irrational"
MAX_DIGITS = 30  # larger integers are left to the symbolic path
_SQRT = re.compile(r"^(-?\d*)\\sqrt(?:\{(\d+)\}|(\d))$")
_LOG = re.compile(r"^\\log_(?:\{(\d+)\}|(\d))(?:\{(\d+)\}|\((\d+)\)|(\d+))$")
_LN = re.compile(r"^\\ln(?:\{(\d+)\}|\((\d+)\)|(\d+))$")


_Q = r"(\d+(?:\.\d+)?|\.\d+)"  # an unsigned decimal
_MUL = r"(?:\\cdot|\\times|\*)?"
_PI_FORMS = (  # (regex, numerator group, denominator group); a missing group is 1
    (re.compile(rf"^{_Q}?{_MUL}\\pi$"), 1, None),  # 2\pi, \pi
    (re.compile(rf"^\\pi{_MUL}{_Q}$"), 1, None),  # \pi\cdot2
    (re.compile(rf"^\\frac\{{{_Q}?{_MUL}\\pi\}}\{{{_Q}\}}$"), 1, 2),  # \frac{3\pi}{2}
    (re.compile(rf"^\\frac\{{{_Q}\}}\{{{_Q}\}}{_MUL}\\pi$"), 1, 2),  # \frac{3}{2}\pi
    (re.compile(rf"^{_Q}?{_MUL}\\pi/{_Q}$"), 1, 2),  # 3\pi/2
)


def pi_coefficient(s: str) -> Fraction | None:
    """``c`` when ``s`` is ``c·π`` with ``c`` rational (sign in front), else None."""
    sign = -1 if s.startswith("-") else 1
    body = s[1:] if s[:1] in "+-" else s
    if len(body) > 3 * MAX_DIGITS:
        return None
    for pattern, num, den in _PI_FORMS:
        m = pattern.match(body)
        if m:
            numerator = Fraction(m.group(num)) if m.group(num) else Fraction(1)
            denominator = Fraction(m.group(den)) if den else Fraction(1)
            return sign * numerator / denominator if denominator else None
    return None


def _perfect_power(n: int) -> tuple[int, int]:
    """(r, m) with n = r**m and m as large as possible (n >= 2)."""
    for m in range(n.bit_length(), 1, -1):
        r = round(n ** (1.0 / m))
        for cand in (r - 1, r, r + 1):
            if cand >= 2 and cand**m == n:
                return cand, m
    return n, 1


def _first(*groups: str | None) -> int:
    return int(next(g for g in groups if g))


def value(s: str) -> Fraction | str | None:
    s = "".join(s.split())
    if len(s) > 3 * MAX_DIGITS:
        return None
    if m := _SQRT.match(s):
        coeff = -1 if m.group(1) == "-" else int(m.group(1)) if m.group(1) else 1
        n = _first(m.group(2), m.group(3))
        root = math.isqrt(n)
        if root * root == n:
            return Fraction(coeff * root)
        return Fraction(0) if coeff == 0 else IRRATIONAL
    if m := _LOG.match(s):
        base, arg = _first(m.group(1), m.group(2)), _first(m.group(3), m.group(4), m.group(5))
        if base < 2 or arg < 1:
            return None
        if arg == 1:
            return Fraction(0)
        (rb, mb), (ra, ma) = _perfect_power(base), _perfect_power(arg)
        return Fraction(ma, mb) if ra == rb else IRRATIONAL
    if m := _LN.match(s):
        arg = _first(m.group(1), m.group(2), m.group(3))
        if arg < 1:
            return None
        return Fraction(0) if arg == 1 else IRRATIONAL
    return None
