"""Symbolic equivalence of two normalised LaTeX answers (runs inside killable workers).

Rules, strict on purpose (a close-looking wrong answer must be wrong):
- numbers compare exactly: decimals become exact rationals (``0.5 == 1/2``,
  ``0.333 != 1/3``, ``3.14 != \\pi``); no relative tolerance, no ×100 percent tricks; the one
  exception is ``numeric``'s rounding rule: a decimal of at least 15 significant digits
  against a constant (``4.123105625617661`` is ``\\sqrt{17}`` rounded to its places);
- expressions are equal when their difference simplifies to 0 (``\\sqrt{12} == 2\\sqrt{3}``);
- sets and bare comma lists compare as multisets, tuples and matrices element-wise,
  intervals by endpoints and openness; set expressions (``\\{1,3\\}\\cup\\{2,4\\}``) are
  evaluated first;
- equations are equal up to a non-zero constant factor (``2x+4y-3=0`` is
  ``y=-\\frac12x+\\frac34``), inequalities up to a positive one (``-x>-1`` is ``x<1``, never
  ``x>1``); a factor with a variable in it never counts;
- division by zero is never a value: an answer containing ``zoo``/``nan`` (``12:00``,
  ``\\frac{1}{0}``) equals nothing (the same text is still accepted, before this module);
- ``i`` is the imaginary unit.
Parses and verdicts are memoised per worker (bounded LRU); both are pure functions of the
strings. This module may hang on adversarial input; callers run it under a hard time limit.
"""

from __future__ import annotations

import functools

import sympy
from latex2sympy2_extended import latex2sympy

from services.reward import numeric

_I = sympy.Symbol("i")


def _split_top_level(s: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in (x.strip() for x in parts) if p]


def parse(s: str) -> sympy.Basic:
    """LaTeX → sympy. Cached per worker: ground truths repeat for every sample of a prompt."""
    got = _parse_cached(s)
    if got is None:
        raise ValueError(f"unparsable answer: {s[:80]!r}")
    return got


def clear_cache() -> None:
    _parse_cached.cache_clear()
    symbolic_equal.cache_clear()


@functools.lru_cache(maxsize=4096)
def _parse_cached(s: str) -> sympy.Basic | None:
    try:
        expr = latex2sympy(s)
    except Exception:  # noqa: BLE001 - cached as None: an unparsable answer stays unparsable
        return None
    if isinstance(expr, sympy.Basic) and _I in expr.free_symbols:
        expr = expr.subs(_I, sympy.I)
    return None if _undefined(expr) else expr


def _undefined(x: object) -> bool:
    """Whether ``x`` holds a division by zero (``zoo``) or an undefined value (``nan``)."""
    if isinstance(x, list | tuple):
        return any(_undefined(y) for y in x)
    if isinstance(x, sympy.MatrixBase):
        return any(_undefined(y) for y in x)
    return isinstance(x, sympy.Basic) and x.has(sympy.zoo, sympy.nan)


def _exact(e: sympy.Basic) -> sympy.Basic:
    if isinstance(e, sympy.Basic) and e.atoms(sympy.Float):
        return e.xreplace({f: sympy.Rational(str(f)) for f in e.atoms(sympy.Float)})
    return e


_PROBES = (sympy.Rational(7, 10), sympy.Rational(13, 10), sympy.Rational(29, 10))


def _certainly_different(diff: sympy.Basic) -> bool:
    """True when ``diff`` is visibly non-zero at a probe point (30-digit evaluation).

    Only ever used to reject early: equality still needs an exact proof below.
    """
    symbols = sorted(diff.free_symbols, key=str)
    points = [dict.fromkeys(symbols, p) for p in _PROBES] if symbols else [{}]
    for point in points:
        try:
            value = complex(diff.subs(point).evalf(30))
        except (TypeError, ValueError, ZeroDivisionError, AttributeError):
            continue
        if value == value and abs(value) > 1e-12:  # value == value: not NaN
            return True
    return False


def _expr_equal(a: sympy.Basic, b: sympy.Basic) -> bool:
    a, b = _exact(a), _exact(b)
    if a == b:
        return True
    try:
        # Unevaluated parses keep the order they were written in: rebuild them canonically
        # ("15+2\sqrt{33}" vs "2\sqrt{33}+15" inside a radical otherwise costs a full simplify).
        a, b = a.doit(), b.doit()
        if _undefined(a) or _undefined(b):
            return False  # "\\frac{\\pi}{0}" only shows its zoo once evaluated
        if a == b:
            return True
        diff = a - b
        if _undefined(diff):
            return False
        if _certainly_different(diff):
            return False
        if sympy.expand(diff) == 0:
            return True
        if sympy.simplify(diff) == 0:
            return True
        # Constants only: split logs of numbers (log_2 8 = log 8 / log 2 = 3). force=True is
        # exact for positive numeric arguments; never used on symbols, where it could be wrong.
        return not diff.free_symbols and sympy.simplify(sympy.expand_log(diff, force=True)) == 0
    except (TypeError, ValueError, AttributeError, NotImplementedError):
        return False


def equal(a: object, b: object) -> bool:  # noqa: PLR0911 - one branch per kind of answer
    if isinstance(a, list | tuple) or isinstance(b, list | tuple):
        if not (isinstance(a, list | tuple) and isinstance(b, list | tuple)) or len(a) != len(b):
            return False
        return all(equal(x, y) for x, y in zip(a, b, strict=True))
    a, b = _explicit_matrix(a), _explicit_matrix(b)
    if isinstance(a, sympy.MatrixBase) or isinstance(b, sympy.MatrixBase):
        return (
            isinstance(a, sympy.MatrixBase)
            and isinstance(b, sympy.MatrixBase)
            and a.shape == b.shape
            and all(equal(x, y) for x, y in zip(a, b, strict=True))
        )
    a, b = _evaluate_sets(a), _evaluate_sets(b)
    if isinstance(a, sympy.FiniteSet) or isinstance(b, sympy.FiniteSet):
        if not (isinstance(a, sympy.FiniteSet) and isinstance(b, sympy.FiniteSet)):
            return False
        return _multiset_equal(list(a.args), list(b.args))
    if isinstance(a, sympy.Tuple) or isinstance(b, sympy.Tuple):
        return isinstance(a, sympy.Tuple) and isinstance(b, sympy.Tuple) and equal(list(a), list(b))
    if isinstance(a, sympy.Interval) or isinstance(b, sympy.Interval):
        return (
            isinstance(a, sympy.Interval)
            and isinstance(b, sympy.Interval)
            and a.left_open == b.left_open
            and a.right_open == b.right_open
            and _expr_equal(a.start, b.start)
            and _expr_equal(a.end, b.end)
        )
    if isinstance(a, sympy.Union) or isinstance(b, sympy.Union):
        return (
            isinstance(a, sympy.Union)
            and isinstance(b, sympy.Union)
            and _multiset_equal(list(a.args), list(b.args))
        )
    if isinstance(a, sympy.And) or isinstance(b, sympy.And):
        return (
            isinstance(a, sympy.And)
            and isinstance(b, sympy.And)
            and _multiset_equal(list(a.args), list(b.args))
        )
    if isinstance(a, sympy.Rel) or isinstance(b, sympy.Rel):
        return isinstance(a, sympy.Rel) and isinstance(b, sympy.Rel) and _relations_equal(a, b)
    if isinstance(a, sympy.Basic) and isinstance(b, sympy.Basic):
        if isinstance(a, sympy.Set) or isinstance(b, sympy.Set):
            return a == b
        return _expr_equal(a, b)
    return False


_SETS = (sympy.Union, sympy.Intersection, sympy.Complement)


def _explicit_matrix(x: object) -> object:
    """A sum or product of explicit matrices (``A + B``, ``AB``) carried out."""
    if isinstance(x, sympy.MatrixExpr) and not isinstance(x, sympy.MatrixBase):
        done = x.doit()
        return done if isinstance(done, sympy.MatrixBase) else x
    return x


def _evaluate_sets(x: object) -> object:
    """``\\{1,3\\}\\cup\\{2,4\\}`` → ``\\{1,2,3,4\\}``: set operations carried out (exactly)."""
    if isinstance(x, _SETS):
        return type(x)(*(_evaluate_sets(arg) for arg in x.args))
    return x


def _canonical(rel: sympy.Rel) -> tuple[str, sympy.Basic]:
    """A relation as ``(kind, e)`` meaning ``e > 0``, ``e >= 0``, ``e = 0`` or ``e != 0``."""
    if isinstance(rel, sympy.StrictGreaterThan | sympy.GreaterThan):
        return (">" if isinstance(rel, sympy.StrictGreaterThan) else ">="), rel.lhs - rel.rhs
    if isinstance(rel, sympy.StrictLessThan | sympy.LessThan):
        return (">" if isinstance(rel, sympy.StrictLessThan) else ">="), rel.rhs - rel.lhs
    return ("=" if isinstance(rel, sympy.Equality) else "!="), rel.lhs - rel.rhs


def _relations_equal(a: sympy.Rel, b: sympy.Rel) -> bool:
    """Same relation up to a constant factor: positive for inequalities, non-zero otherwise."""
    (ka, ea), (kb, eb) = _canonical(a), _canonical(b)
    if ka != kb:
        return False
    ea, eb = _exact(ea).doit(), _exact(eb).doit()
    if _undefined(ea) or _undefined(eb):
        return False
    if _expr_equal(ea, eb):
        return True
    if ka in ("=", "!=") and _expr_equal(ea, -eb):
        return True
    try:
        ratio = sympy.cancel(ea / eb)
        if ratio.free_symbols:
            ratio = sympy.simplify(ratio)
    except (TypeError, ValueError, AttributeError, NotImplementedError, ZeroDivisionError):
        return False
    if ratio.free_symbols or _undefined(ratio) or ratio.has(sympy.oo, -sympy.oo) or ratio == 0:
        return False
    return bool(ratio.is_positive) if ka in (">", ">=") else bool(ratio.is_nonzero)


def _multiset_equal(xs: list[object], ys: list[object]) -> bool:
    if len(xs) != len(ys):
        return False
    remaining = list(ys)
    for x in xs:
        for k, y in enumerate(remaining):
            if equal(x, y):
                del remaining[k]
                break
        else:
            return False
    return True


def _rounds_to(decimal: str, exact: str) -> bool:
    """``numeric``'s approximation rule against a constant expression (``\\sqrt{17}``)."""
    try:
        value = parse(exact)
        if not isinstance(value, sympy.Expr) or value.free_symbols or not value.is_real:
            return False
        n = numeric.places(decimal, numeric.MIN_SIGNIFICANT_IRRATIONAL) or 0
        estimate = sympy.Rational(str(sympy.N(value, n + 30)))
        return bool(abs(sympy.Rational(decimal) - estimate) <= sympy.Rational(1, 2 * 10**n))
    except Exception:  # noqa: BLE001 - unparsable or not a number: not equivalent
        return False


def _as_value(s: str) -> object:
    """A bare top-level comma list (``1, 2``) is an unordered list of answers."""
    parts = _split_top_level(s)
    if len(parts) > 1 and not (s[:1] in "([{" or s.startswith("\\{")):
        return sympy.FiniteSet(*[parse(p) for p in parts], evaluate=False)
    return parse(s)


@functools.lru_cache(maxsize=4096)
def symbolic_equal(pred: str, truth: str) -> bool:
    """Cached per worker: a prompt's samples often repeat the same answer (pure function)."""
    for decimal, other in ((pred, truth), (truth, pred)):
        long_decimal = numeric.places(decimal, numeric.MIN_SIGNIFICANT_IRRATIONAL) is not None
        if long_decimal and not numeric.is_decimal(other):
            return _rounds_to(decimal, other)
    try:
        a, b = _as_value(pred), _as_value(truth)
    except Exception:  # noqa: BLE001 - unparsable answer: not equivalent
        return False
    try:
        return bool(equal(a, b))
    except Exception:  # noqa: BLE001 - sympy raising on exotic input: not equivalent
        return False
