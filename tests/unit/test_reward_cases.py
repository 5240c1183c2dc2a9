"""The hand-labelled grading cases (tests/data/reward_cases.jsonl), one test per category.

Graded once per session by the real grader (symbolic path in its killable worker pool).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from services.reward.exact import to_fraction
from services.reward.grader import Grader, Verdict
from services.reward.normalize import normalize
from services.reward.shape import split_top

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


# -- property: a correct answer turned wrong is never accepted ---------------------------------
# Each correct labelled case is turned into wrong ones by mutating its ground truth (the
# response, as the model wrote it, now answers a different question): the last integer off by
# one, an ordered pair swapped, an item dropped from a list, the value scaled by 2.
_INT = re.compile(r"\d+")


def _off_by_one(truth: str) -> str | None:
    matches = list(_INT.finditer(truth))
    if not matches:
        return None
    last = matches[-1]
    return truth[: last.start()] + str(int(last.group()) + 1) + truth[last.end() :]


def _swap_first_two(items: list[str]) -> list[str] | None:
    if len(items) < 2 or items[0].strip() == items[1].strip():
        return None
    return [items[1], items[0], *items[2:]]


def _swapped(truth: str) -> str | None:
    """(a,b) → (b,a); ``x=2, y=3`` → ``x=3, y=2``; ``L=(a,b)`` → ``L=(b,a)``. Never a set."""
    items = split_top(truth)
    if len(items) >= 2 and all(i.count("=") == 1 for i in items):
        lhs, rhs = zip(*(i.split("=") for i in items), strict=True)
        if len(set(lhs)) == len(lhs) and (swapped := _swap_first_two(list(rhs))):
            return ", ".join(f"{k}={v}" for k, v in zip(lhs, swapped, strict=True))
        return None
    if len(items) == 1 and truth.count("=") == 1:
        label, value = truth.split("=")
        inner = _swapped(value.strip())
        return f"{label}={inner}" if inner else None
    if truth.startswith("(") and truth.endswith(")"):
        inner = _swap_first_two(split_top(truth[1:-1]))
        return "(" + ",".join(inner) + ")" if inner else None
    return None


def _dropped(truth: str) -> str | None:
    if truth.startswith("\\{") and truth.endswith("\\}"):
        items = split_top(truth[2:-2])
        return "\\{" + ",".join(items[:-1]) + "\\}" if len(items) >= 2 else None
    items = split_top(truth)
    if len(items) >= 2:
        return ",".join(items[:-1])
    if truth.startswith("(") and truth.endswith(")") and len(split_top(truth[1:-1])) >= 3:
        return "(" + ",".join(split_top(truth[1:-1])[:-1]) + ")"
    return None


def _scaled(truth: str) -> str | None:
    norm = normalize(truth)
    if re.search(r"[,=<>]|\\(?:leq|geq|neq|in|infty|emptyset)|:", norm) or re.fullmatch(r"[a-z]*", norm):
        return None
    value = to_fraction(norm)
    if value == 0:
        return None
    return f"2\\left({truth}\\right)"


MUTATIONS = {"off_by_one": _off_by_one, "swapped": _swapped, "dropped": _dropped, "scaled": _scaled}


def _mutants() -> list[tuple[str, str, str, str]]:
    """(mutation, response, original truth, mutated truth) for every correct labelled case."""
    out = []
    for case in CASES:
        if not case["correct"]:
            continue
        for name, mutate in MUTATIONS.items():
            wrong = mutate(case["ground_truth"])
            if wrong is not None and normalize(wrong) != normalize(case["ground_truth"]):
                out.append((name, case["response"], case["ground_truth"], wrong))
    return out


def test_mutated_correct_answers_are_never_accepted():
    mutants = _mutants()
    by_kind = {name: sum(m[0] == name for m in mutants) for name in MUTATIONS}
    assert all(n >= 15 for n in by_kind.values()), by_kind  # every mutation really exercised

    async def run() -> list[Verdict]:
        grader = Grader(workers=2, timeout_s=5.0)
        await grader.start()
        try:
            return list(await asyncio.gather(*(grader.grade(m[1], m[3]) for m in mutants)))
        finally:
            await grader.stop()

    accepted = [(m, v.reason) for m, v in zip(mutants, asyncio.run(run()), strict=True) if v.correct]
    assert accepted == []
