"""Canonical text of an answer before any comparison.

Invariant: normalisation only removes presentation (spacing macros, ``\\left``/``\\right``,
``\\dfrac``, text wrappers, units, degree marks, dollar and percent signs, thousands
separators, trailing periods, letter case of text answers), spells relations one way
(``<=``, ``\\le``, an over-escaped ``\\\\le`` → ``\\leq``), turns the words
 "and"/"or" between parts into commas and puts
braces on TeX shorthand (``\\sqrt3``, ``\\frac12``). It never changes a value and never
guesses between a list and a number: only ``1,000``-style groups (1-3 digits, then groups of
exactly 3, no space after a comma) are one number; ``32, 349`` stays a list of two.
Labels (``x =``, ``f(3) =``) are kept: ``shape`` decides what they mean.
"""

from __future__ import annotations

import re

_WRAPPER_NAMES = r"text|textbf|textit|textrm|textnormal|textsf|mathrm|mathbf|mathit|mathsf|operatorname|mbox"
_WRAPPERS = re.compile(rf"\\(?:{_WRAPPER_NAMES})\s*\{{([^{{}}]*)\}}")
_SPACING = re.compile(r"(?<!\\)\\[,;:> ]|\\q?quad|~")
_NEGATIVE_SPACE = re.compile(r"\\!")
_TEX_THOUSANDS = re.compile(r"(?<=\d),\\!\s*(?=\d{3}(?!\d))")  # "32,\! 349": MATH's thousands comma
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_UNIT_WORDS = (
    "square units",
    "sq units",
    "square feet",
    "square inches",
    "square meters",
    "square centimeters",
    "square miles",
    "sq ft",
    "cubic units",
    "cubic feet",
    "cubic inches",
    "cubic meters",
    "cubic centimeters",
    "units",
    "unit",
    "degrees",
    "degree",
    "radians",
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
    "years",
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
    "percentage",
    "percent",
    "pct",
)
_UNIT_ALT = "|".join(re.escape(u) for u in _UNIT_WORDS)
_POWER = r"(?:\^\s*\{?\s*[23]\s*\}?)?"
# "4\pi \text{ cm}^2", "125\textnormal{ miles}": a unit inside a text wrapper, after a value.
_WRAPPED_UNIT = re.compile(
    rf"(?<=\S)\s*\\(?:{_WRAPPER_NAMES})\s*\{{\s*(?:{_UNIT_ALT})\s*\}}{_POWER}\s*$", re.I
)
# "12 cm", "28 percent", "5cm^2", "4\pi cm": a bare unit word after a number, a bracket or \pi.
_UNITS = re.compile(rf"(?:(?<=[\d}}).])|(?<=\\pi))\s*(?:{_UNIT_ALT}){_POWER}$", re.I)
_TEXT_CONNECTIVE = re.compile(rf"\\(?:{_WRAPPER_NAMES})\s*\{{\s*(,?\s*(?:and|or)|,)\s*\}}")
_CONNECTIVE = re.compile(r"(?<=\S)\s*,?\s*\b(?:and|or)\b\s*(?=\S)")
_THOUSANDS = re.compile(r"^[+-]?[1-9]\d{0,2}(?:(?:,|\s*\{,\}\s*)\d{3})+(?:\.\d+)?$")  # "0,111": no
_TEX_COMMA = re.compile(r"\{\s*,\s*\}")  # "{,}" and "{, }": TeX's comma without a space after it
# Relations, one spelling each; "\le" only as a whole macro (not "\left", "\leq").
_RELATIONS = (
    (re.compile(r"<=|≤|\\leqslant(?![a-zA-Z])|\\le(?![a-zA-Z])"), r"\\leq "),
    (re.compile(r">=|≥|\\geqslant(?![a-zA-Z])|\\ge(?![a-zA-Z])"), r"\\geq "),
    (re.compile(r"!=|≠|\\ne(?![a-zA-Z])"), r"\\neq "),
    (re.compile(r"\\lt(?![a-zA-Z])"), "<"),
    (re.compile(r"\\gt(?![a-zA-Z])"), ">"),
)
# Whitespace goes, except after a macro name followed by a letter: "\pi r" must not become "\pir".
_WHITESPACE = re.compile(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])|\s+")
# TeX shorthand takes one token per argument: "\sqrt3", "\frac12", "\frac{1}2", "\log_28" get braces.
_SQRT_TOKEN = re.compile(r"\\sqrt ?([0-9a-zA-Z])")
_LOG_BASE_TOKEN = re.compile(r"\\log_([0-9a-zA-Z])")
_FRAC_TOKENS = re.compile(r"\\frac ?(\{[^{}]*\}|[0-9a-zA-Z]) ?(\{[^{}]*\}|[0-9a-zA-Z])")
_OVER_ESCAPED = re.compile(
    r"\\\\(?=(?:le|ge|leq|geq|neq|in|cup|cap|infty|frac|sqrt|pi|text|boxed)(?![a-zA-Z]))"
)
_EMPTY_SET = re.compile(r"\\varnothing|\\\{\\\}|\\O(?![a-zA-Z])")
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _brace(arg: str) -> str:
    return arg if arg.startswith("{") else "{" + arg + "}"


def strip_math_delimiters(s: str) -> str:
    s = s.strip()
    for left, right in _MATH_DELIMITERS:
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def _outer_braces(s: str) -> str:
    """``{1,2}`` → ``1,2``: a TeX group around the whole answer is presentation."""
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and not s.startswith("\\{"):
        depth = 0
        for i, ch in enumerate(s):
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0 and i < len(s) - 1:
                return s  # "{a}{b}": the first brace closes early
        s = s[1:-1]
    return s


def normalize(answer: str) -> str:
    s = strip_math_delimiters(answer).replace("\\$", "").replace("$", " ")
    if "\\begin" not in s:  # "\\\\le": an over-escaped macro, never a line break before "le"
        s = _OVER_ESCAPED.sub(r"\\", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for pattern, spelling in _RELATIONS:
        s = pattern.sub(spelling, s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", " ").replace("%", " ")
    s = s.strip().rstrip(".").strip()
    s = _WRAPPED_UNIT.sub("", s)
    s = _TEXT_CONNECTIVE.sub(r" \1 ", s)
    for _ in range(3):  # nested wrappers
        s = _WRAPPERS.sub(r"\1", s)
    s = _SPACING.sub(" ", _NEGATIVE_SPACE.sub("", _TEX_THOUSANDS.sub("{,}", s))).strip().rstrip(".").strip()
    s = _UNITS.sub("", s).strip()
    s = _CONNECTIVE.sub(",", s)
    s = _TEX_COMMA.sub("{,}", s)
    if _THOUSANDS.match(s):  # before whitespace goes: "32, 349" is a list, never 32349
        s = re.sub(r"\s|\{,\}|,", "", s)
    s = _WHITESPACE.sub(_space, s).replace("{,}", ",")
    s = _SQRT_TOKEN.sub(r"\\sqrt{\1}", s)
    s = _LOG_BASE_TOKEN.sub(r"\\log_{\1}", s)
    s = _FRAC_TOKENS.sub(lambda m: "\\frac" + _brace(m.group(1)) + _brace(m.group(2)), s)
    s = _EMPTY_SET.sub(r"\\emptyset", s)
    s = _outer_braces(s)
    if s.startswith("+") and len(s) > 1:
        s = s[1:]
    choice = re.fullmatch(r"\(([A-Ea-e])\)", s)  # multiple choice: (B) == B
    if choice:
        s = choice.group(1)
    if re.fullmatch(r"[A-Za-z ]+", s):
        s = s.lower()
    return s


def _space(m: re.Match[str]) -> str:
    return m.group(1) + " " if m.group(1) else ""
