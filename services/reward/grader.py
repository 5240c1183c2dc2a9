"""Grade a response against a ground truth: extract → normalise → exact → symbolic.

Invariant: every grade ends in one of the ``Reason`` values; only ``exact``,
``equivalent`` are correct. The fast path (string identity, exact rationals, text) runs
inline; only what it cannot decide goes to the killable symbolic pool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from services.reward.exact import to_fraction
from services.reward.extract import extract_answer
from services.reward.normalize import normalize
from services.reward.workers import SymbolicPool

Reason = Literal[
    "exact", "equivalent", "mismatch", "no_answer", "timeout", "invalid_ground_truth"
]
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


def fast_grade(response: str, ground_truth: str) -> Verdict | Pending:
    extracted = extract_answer(response)
    if extracted is None:
        return Verdict(False, None, "no_answer")
    truth = normalize(ground_truth)
    if not truth:
        return Verdict(False, extracted, "invalid_ground_truth")
    pred = normalize(extracted)
    if pred == truth:
        return Verdict(True, extracted, "exact")
    tf, pf = to_fraction(truth), to_fraction(pred)
    if tf is not None and pf is not None:
        return Verdict(tf == pf, extracted, "exact" if tf == pf else "mismatch")
    if _TEXTY.match(truth) or _TEXTY.match(pred) or not pred:
        return Verdict(False, extracted, "mismatch")
    return Pending(extracted, pred, truth)


class Grader:
    def __init__(self, workers: int, timeout_s: float) -> None:
        self.pool = SymbolicPool(workers, timeout_s)

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()

    async def grade(self, response: str, ground_truth: str) -> Verdict:
        first = fast_grade(response, ground_truth)
        if isinstance(first, Verdict):
            return first
        same = await self.pool.check(first.pred, first.truth)
        if same is None:
            return Verdict(False, first.extracted, "timeout")
        return Verdict(same, first.extracted, "equivalent" if same else "mismatch")
