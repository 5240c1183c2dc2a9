"""Grade a response against a ground truth: extract → normalise → exact → symbolic.

Invariant: every grade ends in one of the ``Reason`` values; only ``exact``,
``equivalent`` are correct. The fast path (string identity, exact rationals, text) runs
inline and is linear in the response length; only what it cannot decide goes to the
killable symbolic pool. An extracted answer longer than ``max_answer_chars`` (or twice the
ground truth, whichever is more) is cut off before any parsing as incorrect with reason
``timeout`` — the same outcome as an answer whose check runs past the limit, reached in
microseconds instead of after tying up a worker until it is killed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from services.reward import exact_special
from services.reward.exact import compare_structures, to_fraction, to_structure
from services.reward.extract import extract_answer
from services.reward.normalize import split_normalize
from services.reward.workers import SymbolicPool

Reason = Literal["exact", "equivalent", "mismatch", "no_answer", "timeout", "invalid_ground_truth"]
MAX_ANSWER_CHARS = 1000
_TEXTY = re.compile(r"^[a-z][a-z ]*$")


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
    truth_var, truth = split_normalize(ground_truth)
    if not truth:
        return Verdict(False, extracted, "invalid_ground_truth")
    pred_var, pred = split_normalize(extracted)
    if pred_var is not None and truth_var is not None and pred_var != truth_var:
        return Verdict(False, extracted, "mismatch")  # "y = 3" does not answer "x = 3"
    if pred == truth:
        return Verdict(True, extracted, "exact")
    tf, pf = to_fraction(truth), to_fraction(pred)
    if tf is not None and pf is not None:
        return Verdict(tf == pf, extracted, "exact" if tf == pf else "mismatch")
    if (tf is None) != (pf is None):  # one side a plain number: √n, log_b a, ln a decided exactly
        other = exact_special.value(pred if tf is not None else truth)
        number = tf if tf is not None else pf
        if isinstance(other, Fraction):
            return Verdict(other == number, extracted, "equivalent" if other == number else "mismatch")
        if other == exact_special.IRRATIONAL:
            return Verdict(False, extracted, "mismatch")
    same = compare_structures(to_structure(pred), to_structure(truth))
    if same is not None:
        return Verdict(same, extracted, "equivalent" if same else "mismatch")
    if _TEXTY.match(truth) or _TEXTY.match(pred) or not pred:
        return Verdict(False, extracted, "mismatch")
    return Pending(extracted, pred, truth)


class Grader:
    def __init__(self, workers: int, timeout_s: float, max_answer_chars: int = MAX_ANSWER_CHARS) -> None:
        self.pool = SymbolicPool(workers, timeout_s)
        self.max_answer_chars = max_answer_chars

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()

    async def grade(self, response: str, ground_truth: str) -> Verdict:
        first = fast_grade(response, ground_truth, self.max_answer_chars)
        if isinstance(first, Verdict):
            return first
        same = await self.pool.check(first.pred, first.truth)
        if same is None:
            return Verdict(False, first.extracted, "timeout")
        return Verdict(same, first.extracted, "equivalent" if same else "mismatch")
