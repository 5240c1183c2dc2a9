"""Canonical text of an answer before any comparison.

Invariant: normalisation only removes presentation (spacing macros, ``\\left``/``\\right``,
``\\dfrac``, text wrappers, units, degree marks, dollar signs, thousands separators, a
leading ``x =`` / ``x \\in``, trailing periods, letter case of text answers) and puts braces
on TeX shorthand (``\\sqrt3``, ``\\frac12``). It never changes a value:
``1,5`` is not touched (it may be a list), only ``1,000``-style groups are joined.
"""

from __future__ import annotations

import re

_WRAPPERS = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|operatorname|mbox)\s*\{([^{}]*)\}"
)
_SPACING = re.compile(r"\\[,!;:> ]|\\q?quad|~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_UNIT_WORDS = (
    "square units",
    "sq units",
    "square feet",
    "square inches",
    "square meters",
    "square centimeters",
    "sq ft",
    "cubic units",
    "units",
    "unit",
    "degrees",
    "degree",
    "centimeters",
    "centimeter",
    "meters",
    "meter",
    "kilometers",
    "km",
    "cm",
    "mm",
    "inches",
    "inch",
    "feet",
    "foot",
    "ft",
    "miles",
    "mile",
    "mph",
    "hours",
    "hour",
    "minutes",
    "minute",
    "seconds",
    "second",
    "days",
    "day",
    "dollars",
    "dollar",
    "cents",
    "cent",
    "pounds",
    "kg",
    "grams",
    "liters",
    "ml",
    "points",
    "ways",
    "students",
    "people",
)
_UNITS = re.compile(
    r"(?<=[\d}).])\s*(?:" + "|".join(re.escape(u) for u in _UNIT_WORDS) + r")\s*(?:\^\{?\d\}?)?$", re.I
)
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_LEADING_VAR = re.compile(
    r"^\s*((?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?)\s*(?:=|\\in(?![a-zA-Z]))\s*(?=[^=])"
)
# Whitespace goes, except after a macro name followed by a letter: "\pi r" must not become "\pir".
_WHITESPACE = re.compile(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])|\s+")
# TeX shorthand takes one token per argument: "\sqrt3", "\frac12", "\frac{1}2", "\log_28" get braces.
_SQRT_TOKEN = re.compile(r"\\sqrt ?([0-9a-zA-Z])")
_LOG_BASE_TOKEN = re.compile(r"\\log_([0-9a-zA-Z])")
_FRAC_TOKENS = re.compile(r"\\frac ?(\{[^{}]*\}|[0-9a-zA-Z]) ?(\{[^{}]*\}|[0-9a-zA-Z])")
_EMPTY_SET = re.compile(r"\\varnothing|\\\{\\\}|\\O(?![a-zA-Z])")


def _brace(arg: str) -> str:
    return arg if arg.startswith("{") else "{" + arg + "}"


def strip_math_delimiters(s: str) -> str:
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def split_normalize(answer: str) -> tuple[str | None, str]:
    """(leading variable or None, canonical value): ``"y = 2x+1"`` → ``("y", "2x+1")``."""
    s = strip_math_delimiters(answer)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(3):  # nested wrappers
        s = _WRAPPERS.sub(r"\1", s)
    s = _SPACING.sub("", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    s = _UNITS.sub("", s).strip()
    var = None
    if s.count("=") == 1 or ("=" not in s and "\\in" in s):
        m = _LEADING_VAR.match(s)
        if m:
            var, s = _WHITESPACE.sub(_space, m.group(1)), s[m.end() :]
    s = _WHITESPACE.sub(_space, s).replace("{,}", ",")
    s = _SQRT_TOKEN.sub(r"\\sqrt{\1}", s)
    s = _LOG_BASE_TOKEN.sub(r"\\log_{\1}", s)
    s = _FRAC_TOKENS.sub(lambda m: "\\frac" + _brace(m.group(1)) + _brace(m.group(2)), s)
    s = _EMPTY_SET.sub(r"\\emptyset", s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if s.startswith("+") and len(s) > 1:
        s = s[1:]
    choice = re.fullmatch(r"\(([A-Ea-e])\)", s)  # multiple choice: (B) == B
    if choice:
        s = choice.group(1)
    if re.fullmatch(r"[A-Za-z ]+", s):
        s = s.lower()
    return var, s


def _space(m: re.Match[str]) -> str:
    return m.group(1) + " " if m.group(1) else ""


def normalize(answer: str) -> str:
    return split_normalize(answer)[1]
