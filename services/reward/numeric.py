"""Two number-writing rules: decimal commas, and decimals that approximate an exact value.

**Decimal comma.** ``d,dd`` is one number with a decimal comma (``1000,99`` = 1000.99,
``0,111`` = 0.111) only when all of these hold, else it is left alone (a list, or thousands):
- the other side is one number written with a decimal point (the gold, or the answer, says
  what kind of value is wanted: a decimal);
- one comma, digits on both sides, no space after it (``1, 22`` is a list);
- it cannot be a thousands separator: the digits after it are not exactly three, or the
  digits before it are ``0`` or more than three (``1,222`` stays 1222, which ``normalize``
  already made it).

**Approximation.** A decimal with at least ``MIN_SIGNIFICANT`` significant digits equals an
exact rational (``1/12``, ``8/3``), and one with at least ``MIN_SIGNIFICANT_IRRATIONAL`` (a
double's full precision: a computed value) an irrational constant (``\\sqrt{17}``), when it is
that value rounded to the decimal places written: ``|d - v| <= 1/2 * 10^-n`` for ``n`` places.
So ``0.0833333333333333`` is
``1/12`` and ``2.6667`` is ``8/3``, while ``0.33``, ``0.333``, ``0.67`` (too few digits) and
``2.6666`` (not the rounding) are not, nor is ``3.14159`` ``\\pi``; a value that needs no more
than ``n`` places equals only
itself (``0.1250001`` is not ``1/8``). Two decimals are always compared exactly.
"""

from __future__ import annotations

import re
from fractions import Fraction

MIN_SIGNIFICANT = 5
MIN_SIGNIFICANT_IRRATIONAL = 15
_COMMA_NUMBER = re.compile(r"^([+-]?)(\d+),(\d+)$")
_SPACED_COMMA = re.compile(r",\s")
_POINT_NUMBER = re.compile(r"^[+-]?\d*\.\d+$")
_DECIMAL = re.compile(r"^[+-]?(\d*)\.(\d+)$")


def _comma_as_point(s: str) -> str:
    m = _COMMA_NUMBER.match(s)
    if not m:
        return s
    sign, whole, frac = m.groups()
    if len(frac) == 3 and not (whole == "0" or len(whole) > 3):
        return s  # 1,222: may be thousands, never guessed
    return f"{sign}{whole}.{frac}"


def decimal_comma(pred: str, truth: str, pred_raw: str, truth_raw: str) -> tuple[str, str]:
    """``pred`` and ``truth`` (normalised) with a decimal comma read as a point where the rules
    allow it; ``*_raw`` are the texts as written (a space after a comma is gone once normalised)."""
    if _POINT_NUMBER.match(truth) and not _SPACED_COMMA.search(pred_raw):
        pred = _comma_as_point(pred)
    if _POINT_NUMBER.match(pred) and not _SPACED_COMMA.search(truth_raw):
        truth = _comma_as_point(truth)
    return pred, truth


def places(s: str, min_significant: int = MIN_SIGNIFICANT) -> int | None:
    """Decimal places of a decimal written with at least ``min_significant`` significant digits."""
    m = _DECIMAL.match(s)
    if not m:
        return None
    digits = (m.group(1) + m.group(2)).lstrip("0")
    return len(m.group(2)) if len(digits) >= min_significant else None


def rounds_to(s: str, value: Fraction) -> bool:
    """Whether decimal ``s`` is the exact ``value`` rounded to its places (see the rules)."""
    n = places(s)
    return n is not None and abs(Fraction(s) - value) <= Fraction(1, 2 * 10**n)


def is_decimal(s: str) -> bool:
    return bool(_DECIMAL.match(s))


def approximates(x_text: str, x: Fraction, y_text: str, y: Fraction) -> bool:
    """One side a decimal that is the other's exact value rounded; two decimals never."""
    if is_decimal(x_text) and is_decimal(y_text):
        return False
    return rounds_to(x_text, y) or rounds_to(y_text, x)
