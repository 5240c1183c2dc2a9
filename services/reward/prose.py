"""The value an answer stated in prose gives: "Final Answer: The largest $n$ is 34." → ``34``.

Applies to an answer line (after ``Answer:`` / "the final answer is") whose text outside math
is prose: a word of three letters or more (``and``/``or``/``the`` and TeX macro names do not
count), two when a relation (``=``, ``<``, ``>``) stands outside math, so ``x = 3 and y = 4``
or ``x = 3 \\text{ m}`` are never read as prose. Rules,
strict on purpose:
- only the last sentence counts (its end is a ``.``/``!``/``?`` outside math followed by a
  space and a capital letter; "Therefore", "Thus", "Hence", "So" also start one),
  after "I hope it is correct" is cut: the working before it
  never supplies a value, and the cost is linear in the line, whatever its length;
- a *value* is a math span holding a digit (``$(7, 6)$``) or a number outside math, with its
  sign, decimal mark, thousands separators, a ``/`` and a percent sign (``2/3``, ``100%``);
  a currency sign or unit glued to it is left out (``1,000.99€`` → ``1,000.99``,
  ``1,000.99m²`` → ``1,000.99``); a math span without a digit (``$n$``, ``$f(x)$``) is a name;
- a value right after a negation ("not", "n't", "instead of") is dropped (``it is $3$, not
  $4$`` → ``3``); two values joined by "or" are a hedge: nothing is picked;
- one value left: that one. Several: the last, only when a verb of statement stands right
  before it ("is", "are", "was", "equals", "=", "be", "it's": ``the number is 10 which is
  1,000.99``); otherwise nothing is picked (``5 apples and 3 pears``).
``stated_value`` returns the value's text, or None when the rules pick nothing (the caller
then keeps the line as written, which grades as a mismatch rather than a guess).
"""

from __future__ import annotations

import re

_MIN_WORDS = 1
_RELATION = re.compile(r"[=<>]|\\(?:in|leq?|geq?|neq?)(?![a-zA-Z])")
_HOPE = re.compile(r"\s*i hope it is correct.*$", re.I | re.S)
_MATH = re.compile(r"\$\$(.+?)\$\$|(?<!\\)\$(.+?)(?<!\\)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")
_CONNECTIVES = {"and", "or", "the"}
_SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z])|(?=\b(?:Therefore|Thus|Hence|So)\b)")
# A number in prose: sign, digits with thousands groups or a decimal comma/point, then an
# optional percent sign, currency sign or unit glued to it.
_NUMBER = re.compile(r"(?<![\w.,/])[€£¥$]?([+-]?\d+(?:[.,]\d+)*(?:/\d+)?)(\s?%)?(?![\d/])")
_NEGATION = re.compile(r"(?:\bnot|n't|\binstead of)\s*$", re.I)
_HEDGE = re.compile(r"^\s*,?\s*or\b", re.I)
_STATED = re.compile(r"(?:\bis|\bare|\bwas|\bequals?|=|\bbe|'s|\bby|\bof)\s*$", re.I)
_NEAR = 24  # how far back a negation or a verb of statement may stand


def _masked(line: str) -> str:
    """The line with every math span blanked (same length), so prose rules never see math."""
    return _MATH.sub(lambda m: " " * len(m.group(0)), line)


def is_prose(line: str) -> bool:
    masked = _masked(line)
    words = [w for w in _WORD.findall(masked) if w.lower() not in _CONNECTIVES]
    return len(words) >= _MIN_WORDS + bool(_RELATION.search(masked))


def _last_sentence(line: str) -> str:
    masked = _masked(line)
    start = 0
    for m in _SENTENCE_END.finditer(masked):
        start = m.end()
    return line[start:]


def _values(sentence: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of every value in the sentence, in order."""
    out = []
    for m in _MATH.finditer(sentence):
        inner = next(g for g in m.groups() if g is not None)
        if any(ch.isdigit() for ch in inner):
            out.append((m.start(), m.end(), inner.strip()))
    masked = _masked(sentence)
    for m in _NUMBER.finditer(masked):
        out.append((m.start(), m.end(), m.group(1) + (m.group(2) or "").strip()))
    return sorted(out)


def stated_value(line: str) -> str | None:
    """The value a prose answer line states (see the module rules), or None."""
    sentence = _HOPE.sub("", line).strip().rstrip(".").rstrip()
    sentence = _last_sentence(sentence)
    values = _values(sentence)
    kept = []
    for k, (start, end, text) in enumerate(values):
        if _NEGATION.search(sentence[max(0, start - _NEAR) : start]):
            continue
        if k + 1 < len(values) and _HEDGE.match(sentence[end : values[k + 1][0]]):
            return None  # "12 or 13": a hedge, never a pick
        kept.append((start, text))
    if not kept:
        return None
    if len(kept) > 1 and not _STATED.search(sentence[max(0, kept[-1][0] - _NEAR) : kept[-1][0]]):
        return None
    return kept[-1][1]
