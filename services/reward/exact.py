"""The fast path: exact rational values of plain numeric answers, in pure Python.

Integers, decimals, ``a/b``, ``\\frac{a}{b}`` (also ``\\frac12``), a sign, and scientific
notation (``1.5e3``, ``1.5\\times10^{3}``) become a ``Fraction``; anything else returns
None and is left to the symbolic path. Most DAPO-Math-17k and all AIME ground truths are
integers, so most grades never leave this module. Exponents are bounded: no big powers.

A ratio ``a:b`` is ``a/b``; ``undefined`` spots a plain division by zero (``12:00``,
``\\frac{1}{0}``), which is never a value.

``compare_structures`` decides lists, sets, tuples, intervals and matrices whose elements are
all such numbers (or ``\\infty``), with the symbolic path's rules: ``\\{…\\}`` and bare comma
lists are unordered, ``(…)``/``[…]`` are ordered with their brackets (two items in different
brackets: different intervals, or an interval and a pair; an item may be a decimal that
``numeric``'s rounding rule ties to the other's exact item: ``(0.6,2.6667]`` is
``(\\frac35,\\frac83]``), a list written in a TeX group (``{1,3}``:
braces without a backslash, not a set) against a parenthesised tuple compares in order
(``(1,3)`` yes, ``(3,1)`` no); a bare ``1,3`` against ``(1,3)`` stays undecided (it may be an
interval); a matrix equals only a matrix of the same
shape (``pmatrix``, ``bmatrix``, ``matrix`` or ``array`` alike), a structure is never a single
number. Whatever it is unsure of (duplicates, a set against a sequence, non-numeric elements)
is None: left to the symbolic path, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from services.reward import numeric

_NUM = r"[+-]?(?:\d+\.?\d*|\.\d+)"
_PLAIN = re.compile(rf"^{_NUM}$")
_SLASH = re.compile(rf"^({_NUM})/({_NUM})$")
_FRAC = re.compile(r"^([+-]?)\\frac(?:\{([+-]?\d+)\}|(\d))(?:\{([+-]?\d+)\}|(\d))$")
_SCI = re.compile(rf"^({_NUM})(?:[eE]([+-]?\d+)|(?:\\times|\\cdot|\*|x)10\^\{{?([+-]?\d+)\}}?)$")
_RATIO = re.compile(r"^([+-]?\d+):(\d+)$")
_BY_ZERO = re.compile(r"^[+-]?(?:\d+:0+|\d+/0+|\\frac\{[+-]?\d+\}\{0+\})$")
_MATRIX = re.compile(
    r"^[(\[]?\\begin\{(pmatrix|bmatrix|matrix|array)\}(?:\{[lcr|]*\})?(.*)\\end\{\1\}[)\]]?$", re.S
)
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
        m = _RATIO.match(s)
        if m and int(m.group(2)):
            return Fraction(int(m.group(1)), int(m.group(2)))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def undefined(s: str) -> bool:
    """A plain division by zero: ``12:00``, ``5/0``, ``\\frac{1}{0}``."""
    return bool(_BY_ZERO.match(s))


@dataclass(frozen=True)
class NumericMatrix:
    rows: tuple[tuple[Fraction, ...], ...]


def to_matrix(s: str) -> NumericMatrix | None:
    """A matrix whose entries are all plain numbers (rows ``\\\\``, columns ``&``), or None."""
    m = _MATRIX.match(s)
    if not m:
        return None
    lines = m.group(2).split("\\\\")
    if lines and not lines[-1].strip():
        lines.pop()  # a trailing "\\\\" before \\end
    rows = []
    for line in lines:
        entries = [to_fraction(e.strip()) for e in line.split("&")]
        if any(e is None for e in entries):
            return None
        rows.append(tuple(entries))
    if not rows or len({len(r) for r in rows}) != 1:
        return None
    return NumericMatrix(tuple(rows))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Structure:
    kind: str  # "set" (unordered: \\{…\\} or a bare list) or "seq" (tuple / interval)
    brackets: str  # "" for sets, else the opening and closing bracket, e.g. "[)"
    items: tuple[Fraction | str, ...]  # str: "+inf" / "-inf" (interval ends)
    texts: tuple[str, ...] = ()  # the items as written (for ``numeric``'s rounding rule)
    tex_group: bool = False  # written ``{1,3}``: braces without a backslash, a TeX group


def _split_top_level(s: str) -> list[str] | None:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts if depth == 0 else None


_INFINITY = {"\\infty": "+inf", "+\\infty": "+inf", "-\\infty": "-inf"}


def _numbers(parts: list[str]) -> tuple[Fraction | str, ...] | None:
    values = tuple(_INFINITY.get(p) or to_fraction(p) for p in parts)
    return None if any(v is None for v in values) else values  # type: ignore[return-value]


def to_structure(s: str, tex_group: bool = False) -> Structure | NumericMatrix | Fraction | None:
    """A list/set/tuple/interval/matrix of exact numbers, a parenthesised number, or None.

    ``tex_group``: the answer was written as ``{…}`` (which normalising took off).
    """
    if "\\begin" in s:
        return to_matrix(s)
    if s.startswith("\\{") and s.endswith("\\}"):
        kind, brackets, inner = "set", "", s[2:-2]
    elif len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        kind, brackets, inner = "seq", s[0] + s[-1], s[1:-1]
    else:
        kind, brackets, inner = "set", "", s
    tex_group = tex_group and kind == "set" and not s.startswith("\\{")
    parts = _split_top_level(inner)
    if not parts:
        return None
    values = _numbers(parts)
    if values is None:
        return None
    if len(values) == 1:
        return values[0] if isinstance(values[0], Fraction) else None  # "(3)" is 3
    return Structure(kind, brackets, values, tuple(parts), tex_group)


Exact = Structure | NumericMatrix | Fraction


def _same_item(x: Fraction | str, x_text: str, y: Fraction | str, y_text: str) -> bool:
    """Equal items, or a decimal that is the other (exact) item rounded (``numeric``)."""
    if x == y:
        return True
    if isinstance(x, str) or isinstance(y, str):
        return False
    return numeric.approximates(x_text, x, y_text, y)


def compare_structures(a: Exact | None, b: Exact | None) -> bool | None:
    """Equal / different when certain, None when the symbolic path must decide."""
    if a is None or b is None:
        return None
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    if isinstance(a, NumericMatrix) or isinstance(b, NumericMatrix):
        return a == b  # a matrix is only ever a matrix of the same shape and entries
    if isinstance(a, Fraction) or isinstance(b, Fraction):
        return False  # a number is never a list, set, tuple or interval
    assert isinstance(a, Structure) and isinstance(b, Structure)
    if a.kind == b.kind == "seq" and a.brackets != b.brackets and len(a.items) == len(b.items) == 2:
        return False  # [1,2] vs [1,2): other openness; (1,2) vs [1,2]: other interval or a tuple
    grouped = a.tex_group or b.tex_group
    if grouped and {a.brackets, b.brackets} == {"", "()"} and len(a.items) == len(b.items):
        return a.items == b.items  # "{1,3}" (a TeX group: the list 1,3) is the pair (1,3), in order
    if a.kind != b.kind or a.brackets != b.brackets:
        return None
    if a.kind == "seq":
        return len(a.items) == len(b.items) and all(
            _same_item(x, xt, y, yt) for x, xt, y, yt in zip(a.items, a.texts, b.items, b.texts, strict=True)
        )
    if len(set(a.items)) != len(a.items) or len(set(b.items)) != len(b.items):
        return None  # duplicates: leave multiset-vs-set questions to the symbolic path
    return set(a.items) == set(b.items)
