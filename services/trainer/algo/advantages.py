"""Advantage estimators: GRPO (group-relative outcome) and GAE (critic-based PPO).

Invariants
- GRPO matches verl's ``compute_grpo_outcome_advantage``: per group, ``(r - mean) / (std + eps)``
  with the *unbiased* standard deviation (``torch.std``, Bessel-corrected, as verl uses), ``eps =
  1e-6``; a group of one response gets mean 0 and std 1 (verl's convention). ``norm_by_std=False``
  is Dr. GRPO (``r - mean``). A group whose rewards are all equal gets advantage 0 everywhere.
- The sequence advantage is broadcast to every token whose loss mask is 1 and is 0 elsewhere
  (prompt, interpreter output, padding).
- GAE skips tokens with mask 0 (interpreter output between two policy segments): the value
  bootstrap and the running GAE are carried across them unchanged, as verl's multi-turn GAE does.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

GRPO_EPS = 1e-6


def grpo_outcome_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    eps: float = GRPO_EPS,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """One advantage per response (shape ``[B]``) from scalar rewards ``[B]`` and group ids."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [batch], got shape {tuple(rewards.shape)}")
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries but rewards has {rewards.shape[0]}")
    scores = rewards.detach().to(torch.float32)
    members: dict[Hashable, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    out = torch.empty_like(scores)
    for idx in members.values():
        index = torch.tensor(idx, dtype=torch.long)
        group = scores[index]
        if group.numel() == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = group.mean(), group.std(unbiased=True)
        out[index] = (group - mean) / (std + eps) if norm_by_std else group - mean
    return out


def broadcast_to_tokens(seq_values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` per-sequence values -> ``[B, T]`` on loss-masked tokens, 0 elsewhere."""
    if loss_mask.dim() != 2 or loss_mask.shape[0] != seq_values.shape[0]:
        raise ValueError(f"loss_mask must be [B, T] with B={seq_values.shape[0]}, "
                         f"got {tuple(loss_mask.shape)}")
    return seq_values.unsqueeze(-1) * loss_mask.to(seq_values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalise to zero mean / unit (unbiased) variance over masked entries (verl's masked_whiten)."""
    m = mask.to(values.dtype)
    n = m.sum()
    if n < 2:
        raise ValueError(f"masked_whiten needs at least 2 masked entries, got {int(n)}")
    mean = (values * m).sum() / n
    var = (((values - mean) ** 2) * m).sum() / n * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + eps)


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over response tokens ``[B, T]``; returns ``(advantages, returns)``.

    ``token_rewards`` usually holds the outcome reward on the last policy token. Tokens with
    mask 0 are skipped (their advantage is 0 in the output; returns = advantages + values on
    policy tokens). ``whiten`` normalises advantages over masked tokens (verl's default).
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        raise ValueError("token_rewards, values and mask must all be [B, T] with the same shape")
    m = mask.to(values.dtype)
    with torch.no_grad():
        bsz, length = values.shape
        next_value = torch.zeros(bsz, dtype=values.dtype)
        last_gae = torch.zeros(bsz, dtype=values.dtype)
        adv = torch.zeros_like(values)
        for t in reversed(range(length)):
            delta = token_rewards[:, t] + gamma * next_value - values[:, t]
            candidate = delta + gamma * lam * last_gae
            keep = m[:, t]
            next_value = values[:, t] * keep + (1 - keep) * next_value
            last_gae = candidate * keep + (1 - keep) * last_gae
            adv[:, t] = last_gae
        adv = adv * m
        returns = (adv + values) * m
        if whiten:
            adv = masked_whiten(adv, m) * m
    return adv, returns
