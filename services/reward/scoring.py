"""Score policy: +1 / −1 on correctness, plus optional shaping reported on its own."""

from __future__ import annotations

from services.reward.config import RewardConfig
from services.reward.grader import Verdict


def score(verdict: Verdict, num_tool_calls: int, cfg: RewardConfig) -> tuple[float, float]:
    """(score, shaping): ``score = base + shaping`` where ``base`` depends on correctness only."""
    base = cfg.correct_score if verdict.correct else cfg.incorrect_score
    shaped = base
    if not verdict.correct:
        if cfg.shaping.tool_bonus:
            shaped = min(-0.6, base + 0.1 * num_tool_calls)
        if verdict.reason == "no_answer":
            shaped += cfg.shaping.format_penalty
    return shaped, shaped - base
