"""Evaluation metrics of scored groups: the reference's validation metrics plus tool-use statistics.

Invariants: ``groups[i]`` answers ``jobs[i]``; every rate is over all responses (each prompt
weighs by its number of responses) except ``tool_error_rate``, which is over tool calls
(0 when there were none); a response without a reward counts as incorrect with reward 0.
The reference-named metrics (``val-core/…``, ``val-aux/…``) come unchanged from
``compute_validation_metrics``, so an evaluation and the trainer's validation agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from services.common.config import StrictModel
from services.common.schemas import Group, PromptJob
from services.trainer.algo.validation_metrics import compute_validation_metrics, val_samples


class Spread(StrictModel):
    min: float
    max: float
    mean: float


class EvalSummary(StrictModel):
    prompts: int
    responses: int
    accuracy: float
    reward_mean: float
    tool_use_rate: float
    tool_calls_per_response: float
    tool_error_rate: float
    num_turns: Spread
    response_length: Spread
    generated_tokens_mean: float
    truncated_rate: float
    finish_reasons: dict[str, int]


def _spread(values: Sequence[float]) -> Spread:
    a = np.asarray(values, dtype=np.float64)
    return Spread(min=float(a.min()), max=float(a.max()), mean=float(a.mean()))


def summarize(groups: Sequence[Group]) -> EvalSummary:
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        raise ValueError("no responses to evaluate")
    n = len(trajs)
    calls = sum(t.tool_calls for t in trajs)
    errors = sum(t.tool_errors for t in trajs)
    return EvalSummary(
        prompts=len(groups),
        responses=n,
        accuracy=sum(bool(t.correct) for t in trajs) / n,
        reward_mean=sum(float(t.reward or 0.0) for t in trajs) / n,
        tool_use_rate=sum(t.tool_calls > 0 for t in trajs) / n,
        tool_calls_per_response=calls / n,
        tool_error_rate=errors / calls if calls else 0.0,
        num_turns=_spread([t.turns for t in trajs]),
        response_length=_spread([len(t.response_ids) for t in trajs]),
        generated_tokens_mean=sum(t.num_generated for t in trajs) / n,
        truncated_rate=sum(t.truncated for t in trajs) / n,
        finish_reasons=dict(Counter(str(t.finish_reason) for t in trajs)),
    )


def reference_metrics(jobs: Sequence[PromptJob], groups: Sequence[Group], *, n_bootstrap: int = 1000,
                      seed: int = 42) -> dict[str, float]:
    return compute_validation_metrics(val_samples(jobs, groups), n_bootstrap=n_bootstrap, seed=seed)
