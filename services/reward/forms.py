"""Two answer forms rewritten into the plainer form they mean, before shapes are compared.

- **Solutions as labelled groups.** ``p=5,q=2;p=7,q=2`` (groups split by ``;``, each naming
  the same labels in the same order) is the list of tuples ``(5,2),(7,2)``, in the labels'
  order. Anything else (a group with other labels, or a different order, or a label without a
  value) is left as written.
- **A bound on an absolute value.** ``a \\leq |z| \\leq b`` with numbers ``0 <= a <= b`` (``<``
  for open ends) is ``z \\in [-b,-a] \\cup [a,b]``; the endpoints keep their text, so equal
  answers compare by text and the rest by value.
``rewrite`` returns the rewritten text, or the text unchanged; it is linear in the length.
"""

from __future__ import annotations

import re

from services.reward.exact import to_fraction

_PAIR = re.compile(r"^([A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?)=([^=;,]+)$")
_ABS_BOUND = re.compile(r"^([^<>|\\]+)(\\leq|<)\|([A-Za-z])\|(\\leq|<)([^<>|]+)$")


def _solutions(s: str) -> str | None:
    groups = s.split(";")
    if len(groups) < 2:
        return None
    labels: list[str] | None = None
    tuples = []
    for group in groups:
        pairs = [_PAIR.match(p) for p in group.split(",")]
        if not all(pairs):
            return None
        names = [m.group(1) for m in pairs if m]
        if labels is None:
            labels = names
        if names != labels or len(set(names)) != len(names):
            return None
        values = [m.group(2) for m in pairs if m]
        tuples.append(values[0] if len(values) == 1 else "(" + ",".join(values) + ")")
    return ",".join(tuples)


def _negated(text: str) -> str:
    return text[1:] if text.startswith("-") else "-" + text


def _abs_bound(s: str) -> str | None:
    m = _ABS_BOUND.match(s)
    if not m:
        return None
    low, low_op, var, high_op, high = m.groups()
    lo, hi = to_fraction(low), to_fraction(high)
    if lo is None or hi is None or not 0 <= lo <= hi:
        return None
    left_open, right_open = low_op == "<", high_op == "<"
    neg = ("(" if right_open else "[") + f"{_negated(high)},{_negated(low)}" + (")" if left_open else "]")
    pos = ("(" if left_open else "[") + f"{low},{high}" + (")" if right_open else "]")
    return f"{var}\\in{neg}\\cup{pos}"


def rewrite(s: str) -> str:
    """``s`` in its plainer form (see the module rules), or ``s`` itself."""
    return _solutions(s) or _abs_bound(s) or s
