"""The hand-labelled grading cases (tests/data/reward_cases.jsonl), one test per category.

Graded once per session by the real grader (symbolic path in its killable worker pool).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.reward.grader import Grader, Verdict

CASES = [json.loads(line) for line in (Path(__file__).parents[1] / "data" / "reward_cases.jsonl").open()]
CATEGORIES = sorted({c["category"] for c in CASES})


@pytest.fixture(scope="module")
def verdicts() -> list[Verdict]:
    async def run() -> list[Verdict]:
        grader = Grader(workers=2, timeout_s=5.0)
        await grader.start()
        try:
            return list(
                await asyncio.gather(*(grader.grade(c["response"], c["ground_truth"]) for c in CASES))
            )
        finally:
            await grader.stop()

    return asyncio.run(run())


def test_case_file_is_large_and_balanced():
    assert len(CASES) >= 250
    negatives = sum(not c["correct"] for c in CASES) / len(CASES)
    assert 0.35 <= negatives <= 0.55


@pytest.mark.parametrize("category", CATEGORIES)
def test_category(category, verdicts):
    wrong = [
        (c["response"], c["ground_truth"], c["correct"], v.reason)
        for c, v in zip(CASES, verdicts, strict=True)
        if c["category"] == category and v.correct != c["correct"]
    ]
    assert wrong == []


def test_no_false_accepts_anywhere(verdicts):
    false_accepts = [c for c, v in zip(CASES, verdicts, strict=True) if v.correct and not c["correct"]]
    assert false_accepts == []
