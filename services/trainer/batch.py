"""From scored rollouts to training samples: overlong shaping, GRPO advantages, masks, log-probs.

Invariants
- ``Rollout`` is the trainer's own view of one finished response (the Redis/wire schema is mapped
  onto it by the data path); token ids are used as given, never re-tokenised. Its sequences are
  lists or numpy arrays (the feed's ``PackedGroup`` views), turned into tensors without a
  per-token Python loop when they are arrays.
- ``input_ids = prompt_ids + response_ids``; the loss mask is 0 on the prompt and on interpreter
  tokens (``response_loss_mask`` 0) and 1 on the policy's own tokens; advantages are 0 off the mask.
- Shaped reward = outcome reward + DAPO overlong penalty (when enabled); GRPO advantages are
  computed per ``group_id`` on the shaped rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.trainer.algo.advantages import grpo_outcome_advantages
from services.trainer.algo.dapo import overlong_penalty
from services.trainer.config import OverlongConfig
from services.trainer.packing import TrainSample


@dataclass(frozen=True)
class Rollout:
    group_id: str
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    response_loss_mask: Sequence[int]
    reward: float
    rollout_logprobs: Sequence[float] | None = None
    truncated: bool = False

    def validate(self, index: int) -> None:
        where = f"rollout {index} (group {self.group_id!r})"
        if len(self.prompt_ids) == 0:
            raise ValueError(f"{where}: prompt_ids is empty")
        if len(self.response_ids) == 0:
            raise ValueError(f"{where}: response_ids is empty")
        if len(self.response_loss_mask) != len(self.response_ids):
            raise ValueError(f"{where}: response_loss_mask has {len(self.response_loss_mask)} entries, "
                             f"response_ids has {len(self.response_ids)}")
        if self.rollout_logprobs is not None and len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError(f"{where}: rollout_logprobs has {len(self.rollout_logprobs)} entries, "
                             f"response_ids has {len(self.response_ids)}")


def build_samples(
    rollouts: Sequence[Rollout], *, norm_by_std: bool = True, overlong: OverlongConfig | None = None,
    max_response_len: int | None = None,
) -> tuple[list[TrainSample], dict[str, float]]:
    """Samples in input order plus batch metrics (reward, lengths, truncation, overlong penalty)."""
    if not rollouts:
        raise ValueError("no rollouts")
    for i, r in enumerate(rollouts):
        r.validate(i)
    shaped, penalties = [], []
    for r in rollouts:
        pen = 0.0
        if overlong is not None and overlong.enabled:
            if max_response_len is None:
                raise ValueError("overlong shaping needs max_response_len")
            pen = overlong_penalty(len(r.response_ids), max_response_len=max_response_len,
                                   buffer_len=overlong.buffer_len, penalty_factor=overlong.penalty_factor)
        penalties.append(pen)
        shaped.append(r.reward + pen)
    adv = grpo_outcome_advantages(torch.tensor(shaped, dtype=torch.float32), [r.group_id for r in rollouts],
                                  norm_by_std=norm_by_std)
    samples = []
    for r, a, score in zip(rollouts, adv.tolist(), shaped, strict=True):
        ids = torch.from_numpy(np.concatenate([np.asarray(r.prompt_ids, dtype=np.int64),
                                               np.asarray(r.response_ids, dtype=np.int64)]))
        mask = _after_prompt(r.prompt_ids, r.response_loss_mask)
        rollout_lp = None if r.rollout_logprobs is None else _after_prompt(r.prompt_ids, r.rollout_logprobs)
        samples.append(TrainSample(input_ids=ids, loss_mask=mask, advantages=mask * a,
                                   rollout_logprobs=rollout_lp, reward=score))
    resp_lens = [len(r.response_ids) for r in rollouts]
    metrics = {
        "critic/score/mean": sum(r.reward for r in rollouts) / len(rollouts),
        "critic/rewards/mean": sum(shaped) / len(shaped),
        "critic/advantages/max": float(adv.max()),
        "critic/advantages/min": float(adv.min()),
        "response_length/mean": sum(resp_lens) / len(resp_lens),
        "response_length/max": float(max(resp_lens)),
        "response_length/clip_ratio": sum(r.truncated for r in rollouts) / len(rollouts),
        "overlong/penalty_mean": sum(penalties) / len(penalties),
        "policy_tokens": float(sum(float(s.loss_mask.sum()) for s in samples)),
    }
    return samples, metrics


def _after_prompt(prompt_ids: Sequence[int], values: Sequence[float]) -> torch.Tensor:
    """float32 ``[0.0] * len(prompt_ids) + values``."""
    out = np.zeros(len(prompt_ids) + len(values), dtype=np.float32)
    out[len(prompt_ids):] = values
    return torch.from_numpy(out)
