"""Rollout-vs-trainer log-prob mismatch: the log-probs an engine reported for the policy's tokens
against a teacher-forced recomputation with the weights that version stands for.

Computed in the tests for now (the trainer branch adds mismatch metrics of its own; the two should be
unified). Only the policy's tokens count (``loss_mask`` 1); interpreter tokens are context.
"""

from __future__ import annotations

from typing import Any

import torch

from services.common.schemas import Group


def logprob_mismatch(model: Any, groups: list[Group]) -> dict[str, float]:
    """``{"mismatch/abs_mean", "mismatch/abs_max", "mismatch/tokens"}`` over the trajectories of
    ``groups``."""
    diffs: list[torch.Tensor] = []
    with torch.no_grad():
        for group in groups:
            for traj in group.trajectories:
                ids = list(group.prompt_ids) + list(traj.response_ids)
                logits = model(torch.tensor([ids])).logits[0].float()
                start = len(group.prompt_ids) - 1
                lp = torch.log_softmax(logits[start:start + len(traj.response_ids)], dim=-1)
                recomputed = lp[torch.arange(len(traj.response_ids)), torch.tensor(traj.response_ids)]
                mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
                diffs.append((recomputed - torch.tensor(traj.logprobs, dtype=torch.float32))[mask].abs())
    every = torch.cat(diffs) if diffs else torch.zeros(0)
    if every.numel() == 0:
        raise ValueError("no policy tokens to compare")
    return {"mismatch/abs_mean": float(every.mean()), "mismatch/abs_max": float(every.max()),
            "mismatch/tokens": float(every.numel())}
