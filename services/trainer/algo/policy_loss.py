"""Clipped policy loss (PPO / GRPO / DAPO), clipped value loss, KL estimators, loss aggregation.

Invariants (semantics match verl's ``compute_policy_loss_vanilla`` / ``agg_loss`` / ``kl_penalty``)
- ratio = exp(clamp(logp - old_logp, -20, 20)); per-token loss = max(-A·ratio,
  -A·clip(ratio, 1-clip_low, 1+clip_high)); for A < 0 the dual clip bounds it by -A·c (c > 1).
- Optional truncated importance sampling multiplies the per-token loss by detached weights.
- Aggregation works on padded ``[B, T]`` tensors and on packed 1-D tensors (``seq_index`` names
  the sequence of every token). Normalisers can be passed explicitly so that a mini-batch split
  into micro-batches (or across data-parallel ranks) sums to exactly the full-batch loss:
  ``token-mean``: Σ loss·mask / n_tokens; ``seq-mean-token-mean``: Σ_seq (mean over its masked
  tokens) / n_seqs; ``seq-mean-token-sum``: Σ_seq (sum over its masked tokens) / n_seqs.
  A sequence with no masked token contributes 0 (verl would produce NaN).
- ``ppo_kl`` metric is k1 = mean(old_logp - logp) over masked tokens (verl's ``ppo_kl``); ``ppo_kl_k3``
  is the low-variance, always >= 0 estimator mean(exp(d) - d - 1), d = logp - old_logp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k2", "k3"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _flatten(x: torch.Tensor, seq_index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if seq_index is not None:
        if x.shape != seq_index.shape:
            raise ValueError(f"seq_index shape {tuple(seq_index.shape)} != values shape {tuple(x.shape)}")
        return x.reshape(-1), seq_index.reshape(-1)
    if x.dim() != 2:
        raise ValueError("without seq_index the values must be [B, T]")
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(-1).expand_as(x)
    return x.reshape(-1), rows.reshape(-1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: AggMode | str,
    *,
    seq_index: torch.Tensor | None = None,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Aggregate per-token losses to a scalar (see module docstring for the exact formulas).

    ``num_seqs`` / ``num_tokens`` override the local counts (global mini-batch normalisers).
    With ``seq_index`` the sequence ids must be in ``[0, num_seqs)``.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    values, seqs = _flatten(loss_mat, seq_index)
    mask = loss_mask.reshape(-1).to(values.dtype)
    if mode == "token-mean":
        denom = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1.0)
        return (values * mask).sum() / denom
    n_seq = int(num_seqs) if num_seqs is not None else (int(seqs.max().item()) + 1 if seqs.numel() else 1)
    size = max(n_seq, int(seqs.max().item()) + 1 if seqs.numel() else 0)
    seq_sum = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, seqs, values * mask)
    if mode == "seq-mean-token-mean":
        seq_count = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, seqs, mask)
        seq_sum = seq_sum / seq_count.clamp(min=1.0)
    return seq_sum.sum() / max(n_seq, 1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClipConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float = 3.0

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {self.clip_ratio_c}")


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip: ClipConfig = ClipConfig(),
    agg_mode: AggMode | str = "token-mean",
    is_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> LossOutput:
    """Dual-clip PPO surrogate with asymmetric clip range; metrics are local masked means."""
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip.clip_low, 1.0 + clip.clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip.clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    per_token = torch.where(advantages < 0, dual, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = agg_loss(per_token, loss_mask, agg_mode, seq_index=seq_index, num_seqs=num_seqs,
                    num_tokens=num_tokens)
    with torch.no_grad():
        d = neg_kl.detach()
        metrics = {
            "actor/pg_clipfrac": masked_mean((loss2 > loss1).float(), loss_mask).item(),
            "actor/pg_clipfrac_lower": masked_mean(((clipped > loss3) & (advantages < 0)).float(),
                                                   loss_mask).item(),
            "actor/ppo_kl": masked_mean(-d, loss_mask).item(),
            "actor/ppo_kl_k3": masked_mean(torch.exp(d) - d - 1.0, loss_mask).item(),
        }
        if entropy is not None:
            metrics["actor/entropy"] = masked_mean(entropy.detach(), loss_mask).item()
        if is_weights is not None:
            metrics["actor/tis_weight_mean"] = masked_mean(is_weights.detach(), loss_mask).item()
    return LossOutput(loss=loss, metrics=metrics)


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: KLKind | str) -> torch.Tensor:
    """Per-token KL(π || π_ref) estimators: k1 = d, k2 = d²/2, k3 = exp(-d) + d - 1 (d = logp - ref).

    k3 is clamped to [-10, 10] like verl's ``low_var_kl``.
    """
    d = log_prob - ref_log_prob
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        neg = torch.clamp(-d, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"kl kind must be one of k1, k2, k3, got {kind!r}")


def value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_range_value: float = 0.5,
    agg_mode: AggMode | str = "token-mean",
    seq_index: torch.Tensor | None = None,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> LossOutput:
    """Clipped value loss 0.5·max((v - R)², (clip(v, v_old ± c) - R)²), aggregated like the policy loss."""
    v_clipped = old_values + torch.clamp(vpreds - old_values, -clip_range_value, clip_range_value)
    l1 = (vpreds - returns).square()
    l2 = (v_clipped - returns).square()
    per_token = torch.maximum(l1, l2)
    loss = 0.5 * agg_loss(per_token, loss_mask, agg_mode, seq_index=seq_index, num_seqs=num_seqs,
                          num_tokens=num_tokens)
    with torch.no_grad():
        metrics = {"critic/vf_clipfrac": masked_mean((l2 > l1).float(), loss_mask).item(),
                   "critic/vpred_mean": masked_mean(vpreds.detach(), loss_mask).item()}
    return LossOutput(loss=loss, metrics=metrics)
