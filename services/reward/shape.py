"""Answer shapes: labels, chains, relations and lists, reduced to the two values to compare.

Works on normalised text (``normalize``), in pure Python, linear in the answer length.
Rules, each one strict on purpose:
- a *label* names the value: ``x = 3``, ``f(3) = 9``, ``a_{10} = 4``, ``(p,q) = (3,2)``,
  ``|AB| = 1``, ``V_1:V_2 = 11:21``, ``m+n = 17``, ``x \\in [1,2]``. A labelled answer equals a
  bare one when the values are equal, either way round; two labels must be the same label
  (``y = 3`` never answers ``x = 3``), unless the values are expressions, in which case the
  two are compared as whole equations (``x = (y-1)/2`` is ``y = 2x+1``);
- a *chain* ``x = 5+5+1 = 11`` or ``5 \\cdot 7 = 35`` answers with its last value (anything
  after ``\\approx`` is dropped: ``= 1/3 \\approx 0.33`` answers ``1/3``);
- anything else with a relation (``2x+4y-3=0``, ``-x > -1``) is a *relation*, compared whole by
  the symbolic path (equations up to a non-zero factor, inequalities up to a positive one);
  ``a < x < b`` and ``x > a`` with constant bounds also read as the interval of ``x`` when the
  other side is an interval;
- in a list, labels pair the items: one repeated label (``x = 1, x = 2``) leaves an
  unordered list of values; distinct labels (``AB = 4, CD = 5``) fix the order, by label
  when both sides are labelled, as written when one side is bare. An unlabelled item after
  a labelled one shares its label (``(x,y) = (5,8), (8,5)``).
``align`` returns the two strings to compare by value, or None when the shapes alone prove
the answer wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_NAME = r"(?:[A-Za-z]+|\\(?:alpha|beta|gamma|delta|theta|lambda|mu|phi|varphi|omega|sigma|rho|tau|xi|psi))"
_SUB = r"(?:_(?:\{[^{}=]*\}|[A-Za-z0-9]))?(?:'+|\^\{?\\?(?:\*|prime)\}?)?"
_ONE = rf"{_NAME}{_SUB}"
_LABEL = re.compile(
    rf"""^(?:
        {_ONE}(?:\([^()=]*\))?                 # x, a_{{10}}, f(3), W(n), P(A)
      | \({_ONE}(?:,{_ONE})+\)                 # (p,q), (x,y,z)
      | \|{_ONE}\|                             # |AB|
      | {_ONE}(?::{_ONE})+                     # V_1:V_2, A:B
      | \\frac\{{{_ONE}\}}\{{{_ONE}\}}         # \\frac{{NO}}{{BO}}
      | {_ONE}(?:[+]{_ONE})+                   # m+n, a+b+c
      | \\(?:overline|angle|triangle|widehat)\s?\{{?[A-Za-z]+\}}?  # \\overline{{AB}}, \\angle ABC
    )$""",
    re.X,
)
_CLOSED_MACROS = re.compile(r"\\(?:frac|sqrt|cdot|times|div|pi|infty)(?![a-zA-Z])")
_RELATION_OPS = ("\\leq", "\\geq", "\\neq", "\\in", "=", "<", ">")
_LESS = {"<": True, "\\leq": False}  # op -> strict
_MORE = {">": True, "\\geq": False}
_OPEN_CLOSE = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}


def is_label(s: str) -> bool:
    return bool(_LABEL.match(s))


def is_closed(s: str) -> bool:
    """No variable: digits, operators and the constants/macros of arithmetic only."""
    return bool(s) and not re.search(r"[A-Za-z\\]", _CLOSED_MACROS.sub("", s))


def split_top(s: str, sep: str = ",") -> list[str]:
    """``s`` split at ``sep`` outside any bracket (``[1,2)`` counts as a bracket pair)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += _OPEN_CLOSE.get(ch, 0)
        if ch == sep and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def split_relations(s: str) -> tuple[list[str], list[str]]:
    """(parts, operators) at top level: ``x\\leq5`` → (["x", "5"], ["\\leq"])."""
    parts: list[str] = []
    ops: list[str] = []
    depth, start, i = 0, 0, 0
    while i < len(s):
        ch = s[i]
        depth += _OPEN_CLOSE.get(ch, 0)
        if depth == 0:
            op = next((o for o in _RELATION_OPS if s.startswith(o, i)), None)
            if op is not None and op.startswith("\\") and s[i + len(op) : i + len(op) + 1].isalpha():
                op = None  # "\infty", "\neqq": a longer macro, not the relation
            if op is not None:
                parts.append(s[start:i].strip())
                ops.append(op)
                i += len(op)
                start = i
                continue
        i += 1
    parts.append(s[start:].strip())
    return parts, ops


@dataclass(frozen=True)
class Item:
    """One answer (or one list item): what it names, its value, and the text as written."""

    kind: Literal["value", "labelled", "relation"]
    value: str
    whole: str
    label: str | None = None
    interval: tuple[str, str] | None = None  # (label, interval text) for one-variable inequalities


def _label_key(label: str) -> str:
    return label.replace("{", "").replace("}", "")


def _before_approx(value: str) -> str:
    head = value.split("\\approx", 1)[0]
    return head or value


def _interval(ops: list[str], parts: list[str]) -> tuple[str, str] | None:
    """``a < L \\leq b`` / ``L > a`` / ``a < L`` with constant bounds → (L, interval text)."""
    if len(ops) == 2 and (all(o in _LESS for o in ops) or all(o in _MORE for o in ops)):
        lo, label, hi = parts
        strict = _LESS if ops[0] in _LESS else _MORE
        if ops[0] in _MORE:
            lo, hi = hi, lo
            ops = ops[::-1]
        if is_label(label) and is_closed(lo) and is_closed(hi):
            return label, ("(" if strict[ops[0]] else "[") + f"{lo},{hi}" + (")" if strict[ops[1]] else "]")
        return None
    if len(ops) != 1 or not (ops[0] in _LESS or ops[0] in _MORE):
        return None
    left, right = parts
    op = ops[0]
    if is_closed(left) and is_label(right):  # "5 > x" is "x < 5"
        left, right = right, left
        op = {"<": ">", ">": "<", "\\leq": "\\geq", "\\geq": "\\leq"}[op]
    if not (is_label(left) and is_closed(right)):
        return None
    if op in _LESS:
        return left, f"(-\\infty,{right}" + (")" if op == "<" else "]")
    return left, ("(" if op == ">" else "[") + f"{right},\\infty)"


def parse_item(s: str) -> Item:
    parts, ops = split_relations(s)
    if not ops:
        return Item("value", s, s)
    if any(not p for p in parts):
        return Item("relation", s, s)
    if all(o == "=" for o in ops):
        value = _before_approx(parts[-1])
        first = parts[0]
        if is_label(first):
            return Item("labelled", value, s, _label_key(first))
        if len(ops) > 1 or (is_closed(first) and is_closed(value)):
            return Item("labelled", value, s)  # a chain or a computation: its last value
        return Item("relation", s, s)
    if ops == ["\\in"] and is_label(parts[0]):
        return Item("labelled", parts[1], s, _label_key(parts[0]))
    interval = _interval(ops, parts)
    if interval is not None and len(ops) == 2:
        return Item("labelled", interval[1], s, _label_key(interval[0]))
    return Item("relation", s, s, interval=interval and (_label_key(interval[0]), interval[1]))


def _is_interval_text(s: str) -> bool:
    return len(s) >= 2 and s[0] in "([" and s[-1] in ")]" or "\\cup" in s


def _single(p: Item, t: Item) -> tuple[str, str] | None:
    if p.interval is not None and t.interval is not None:  # "5 \\geq x" vs "x \\leq 5": intervals
        return (p.interval[1], t.interval[1]) if p.interval[0] == t.interval[0] else None
    if p.kind == "relation" or t.kind == "relation":
        for rel, other in ((p, t), (t, p)):
            if rel.interval is not None and other.kind != "relation" and _is_interval_text(other.value):
                label, interval = rel.interval
                if other.label is not None and other.label != label:
                    return None
                return (interval, other.value) if rel is p else (other.value, interval)
        return p.whole, t.whole
    if p.label is not None and t.label is not None and p.label != t.label:
        if is_closed(p.value) and is_closed(t.value):
            return None  # "y = 3" does not answer "x = 3"
        return p.whole, t.whole
    return p.value, t.value


def _labels(items: list[Item]) -> list[str | None]:
    """Each item's label; an unlabelled item after a labelled one shares its label."""
    out: list[str | None] = []
    for item in items:
        out.append(item.label if item.label is not None else (out[-1] if out else None))
    return out


def _join(values: list[str], ordered: bool) -> str:
    return "(" + ",".join(values) + ")" if ordered else ",".join(values)


def _lists(pred: str, truth: str, ps: list[Item], ts: list[Item]) -> tuple[str, str] | None:
    if any(i.kind == "relation" for i in (*ps, *ts)):
        return pred, truth
    pl, tl = _labels(ps), _labels(ts)
    p_labelled, t_labelled = all(pl), all(tl)
    if (any(pl) and not p_labelled) or (any(tl) and not t_labelled):
        return pred, truth  # some items labelled, some not: compared as written
    pv, tv = [i.value for i in ps], [i.value for i in ts]
    if not p_labelled and not t_labelled:
        return pred, truth
    if p_labelled and t_labelled:
        if set(pl) != set(tl):
            closed = all(is_closed(v) for v in (*pv, *tv))
            return None if closed else (pred, truth)
        if len(set(pl)) == 1:
            return _join(pv, False), _join(tv, False)
        if len(set(pl)) == len(pl) and len(set(tl)) == len(tl):
            by_p, by_t = dict(zip(pl, pv, strict=True)), dict(zip(tl, tv, strict=True))
            keys = sorted(by_p)  # type: ignore[arg-type]
            return _join([by_p[k] for k in keys], True), _join([by_t[k] for k in keys], True)
        return pred, truth
    labels = pl if p_labelled else tl
    ordered = len(set(labels)) > 1
    if ordered and len(pv) != len(tv):
        return None  # a labelled list and a bare one of another length
    return _join(pv, ordered), _join(tv, ordered)


def align(pred: str, truth: str) -> tuple[str, str] | None:
    """The two value strings to compare, or None when the shapes alone make ``pred`` wrong."""
    p_parts, t_parts = split_top(pred), split_top(truth)
    ps, ts = [parse_item(x) for x in p_parts], [parse_item(x) for x in t_parts]
    if len(ps) == 1 and len(ts) == 1:
        return _single(ps[0], ts[0])
    return _lists(pred, truth, ps, ts)
