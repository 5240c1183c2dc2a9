"""Grade a response against a ground truth: extract → normalise → forms → shape → exact → symbolic.

Invariant: every grade ends in one of the ``Reason`` values; only ``exact``,
``equivalent`` are correct. The shape step (labels, chains, relations, labelled lists) only
picks the two values to compare, or rejects outright (``y = 3`` for ``x = 3``); whether two
values are equal is always left to the comparisons after it. The fast path (string identity,
exact rationals, text) runs inline and is linear in the response length; only what it cannot
decide goes to the killable symbolic pool. An extracted answer longer than
``max_answer_chars`` (or twice the ground truth, whichever is more) is cut off before any
parsing as incorrect with reason ``timeout`` — the same outcome as an answer whose check runs
past the limit, reached in microseconds instead of after tying up a worker until it is killed.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from services.reward import exact_special, forms, numeric
from services.reward.exact import compare_structures, to_fraction, to_structure, undefined
from services.reward.extract import extract_answer
from services.reward.normalize import normalize, strip_math_delimiters
from services.reward.shape import align
from services.reward.workers import SymbolicPool

Reason = Literal["exact", "equivalent", "mismatch", "no_answer", "timeout", "invalid_ground_truth"]
MAX_ANSWER_CHARS = 1000
_TEX_GROUP = re.compile(r"^\{[^{}]*,[^{}]*\}$")  # "{1,3}": a TeX group around a list
_TEXTY = re.compile(r"^[a-z][a-z ]+$")  # words; a single letter may be a variable or i


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: str | None
    reason: Reason


@dataclass(frozen=True)
class Pending:
    """A grade the fast path could not decide: compare ``pred`` and ``truth`` symbolically."""

    extracted: str
    pred: str
    truth: str


def fast_grade(
    response: str, ground_truth: str, max_answer_chars: int = MAX_ANSWER_CHARS
) -> Verdict | Pending:
    extracted = extract_answer(response)
    if extracted is None:
        return Verdict(False, None, "no_answer")
    if len(extracted) > max(max_answer_chars, 2 * len(ground_truth)):
        return Verdict(False, extracted, "timeout")
    truth = normalize(ground_truth)
    if not truth:
        return Verdict(False, extracted, "invalid_ground_truth")
    pred, truth = forms.rewrite(normalize(extracted)), forms.rewrite(truth)
    pred, truth = numeric.decimal_comma(pred, truth, extracted, ground_truth)
    if pred == truth:
        return Verdict(True, extracted, "exact")
    aligned = align(pred, truth)
    if aligned is None:
        return Verdict(False, extracted, "mismatch")  # e.g. "y = 3" does not answer "x = 3"
    pred, truth = aligned
    if pred == truth:
        return Verdict(True, extracted, "exact")
    if undefined(pred) or undefined(truth):
        return Verdict(False, extracted, "mismatch")  # a division by zero is never a value
    tf, pf = to_fraction(truth), to_fraction(pred)
    if tf is not None and pf is not None:
        if tf == pf:
            return Verdict(True, extracted, "exact")
        close = numeric.approximates(pred, pf, truth, tf)  # 0.0833333333333333 for 1/12
        return Verdict(close, extracted, "equivalent" if close else "mismatch")
    if (tf is None) != (pf is None):  # one side a plain number: √n, log_b a, ln a decided exactly
        number_text, other_text = (truth, pred) if tf is not None else (pred, truth)
        other = exact_special.value(other_text)
        number = tf if tf is not None else pf
        if isinstance(other, Fraction):
            same = other == number or numeric.rounds_to(number_text, other)
            return Verdict(same, extracted, "equivalent" if same else "mismatch")
        if numeric.places(number_text, numeric.MIN_SIGNIFICANT_IRRATIONAL) is not None:
            return Pending(extracted, pred, truth)  # √17 against 4.123105625617661: by rounding
        if other == exact_special.IRRATIONAL:
            return Verdict(False, extracted, "mismatch")
    p_pi, t_pi = exact_special.pi_coefficient(pred), exact_special.pi_coefficient(truth)
    if p_pi is not None and (t_pi is not None or tf is not None):  # c·π against c·π or a rational
        same = p_pi == t_pi if t_pi is not None else p_pi == 0 and tf == 0
        return Verdict(same, extracted, "equivalent" if same else "mismatch")
    if t_pi is not None and pf is not None:
        same = t_pi == 0 and pf == 0
        return Verdict(same, extracted, "equivalent" if same else "mismatch")
    same = compare_structures(
        to_structure(pred, _TEX_GROUP.match(strip_math_delimiters(extracted)) is not None),
        to_structure(truth, _TEX_GROUP.match(strip_math_delimiters(ground_truth)) is not None),
    )
    if same is not None:
        return Verdict(same, extracted, "equivalent" if same else "mismatch")
    if _TEXTY.match(truth) or _TEXTY.match(pred) or not pred:
        return Verdict(False, extracted, "mismatch")
    return Pending(extracted, pred, truth)


class Overloaded(Exception):
    """More symbolic checks than ``max_queue`` are already admitted: try again later."""

    def __init__(self, admitted: int, max_queue: int, retry_after_s: int) -> None:
        super().__init__(
            f"{admitted} symbolic checks admitted (max_queue={max_queue}); retry after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class Grader:
    def __init__(
        self,
        workers: int,
        timeout_s: float,
        max_answer_chars: int = MAX_ANSWER_CHARS,
        max_queue: int = 4096,
    ) -> None:
        self.pool = SymbolicPool(workers, timeout_s, max_queue)
        self.max_answer_chars = max_answer_chars

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()

    async def grade(self, response: str, ground_truth: str) -> Verdict:
        """One grade; never refused (waits for a worker as long as it takes)."""
        return await self._finish(fast_grade(response, ground_truth, self.max_answer_chars))

    async def grade_many(self, items: list[tuple[str, str]]) -> list[Verdict]:
        """Grades of ``(response, ground_truth)`` pairs, in order, admitted all or none.

        Raises ``Overloaded`` (nothing graded) when their symbolic checks do not fit in the
        queue; the fast path decides the rest first, so only real symbolic work counts.
        """
        firsts = [fast_grade(r, t, self.max_answer_chars) for r, t in items]
        pending = sum(isinstance(f, Pending) for f in firsts)
        if pending and not self.pool.has_room(pending):
            raise Overloaded(self.pool.admitted, self.pool.max_queue, self.pool.retry_after_s())
        return list(await asyncio.gather(*(self._finish(f) for f in firsts)))

    async def _finish(self, first: Verdict | Pending) -> Verdict:
        if isinstance(first, Verdict):
            return first
        same = await self.pool.check(first.pred, first.truth)
        if same is None:
            return Verdict(False, first.extracted, "timeout")
        return Verdict(same, first.extracted, "equivalent" if same else "mismatch")
