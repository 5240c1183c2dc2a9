"""Rollout-vs-trainer log-prob mismatch: the log-probs an engine reported for the policy's tokens
against a teacher-forced recomputation with the weights that version stands for.

The statistics are the trainer's own (``services.trainer.algo.mismatch``, the per-step
``mismatch/*`` metrics); this helper only supplies the recomputation from a plain HF model.
Only the policy's tokens count (``loss_mask`` 1); interpreter tokens are context.
"""

from __future__ import annotations

from typing import Any

import torch

from services.common.schemas import Group
from services.trainer.algo.mismatch import MismatchSums, token_mismatch


def logprob_mismatch(model: Any, groups: list[Group]) -> dict[str, float]:
    """``mismatch/abs_mean``, ``abs_max``, ``k3_kl``, ``tokens`` over the trajectories of ``groups``."""
    sums = MismatchSums()
    with torch.no_grad():
        for group in groups:
            for traj in group.trajectories:
                ids = list(group.prompt_ids) + list(traj.response_ids)
                logits = model(torch.tensor([ids])).logits[0].float()
                start = len(group.prompt_ids) - 1
                lp = torch.log_softmax(logits[start:start + len(traj.response_ids)], dim=-1)
                recomputed = lp[torch.arange(len(traj.response_ids)), torch.tensor(traj.response_ids)]
                sums = sums.merge(token_mismatch(recomputed, torch.tensor(traj.logprobs, dtype=torch.float32),
                                                 torch.tensor(traj.loss_mask, dtype=torch.float32)))
    metrics = sums.metrics()
    if not metrics:
        raise ValueError("no policy tokens to compare")
    metrics.pop("mismatch/tis_capped_frac", None)  # no TIS cap here
    return metrics
