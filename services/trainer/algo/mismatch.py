"""Rollout–trainer mismatch: how far the log-probs the rollout engine reported for its sampled
tokens are from the trainer's log-probs of the same tokens, and the corrections for it.

Definitions (per policy token, ``d = logp_trainer - logp_rollout``, tokens with mask 1 only):
- ``mismatch/abs_mean`` / ``mismatch/abs_max``: mean / max of ``|d|``;
- ``mismatch/k3_kl``: k3 estimate of KL(rollout ‖ trainer) from the rollout's own samples,
  mean of ``exp(d) - 1 - d`` (>= 0, 0 iff the two agree on every token);
- ``mismatch/tis_capped_frac``: fraction of tokens whose importance ratio ``exp(d)`` reaches the
  token-TIS cap ``C`` (their weight is truncated to ``C``);
- sequence-level masked importance sampling (MIS): a sequence whose ratio
  ``exp(Σ d)`` over its policy tokens leaves ``[1/C, C]`` is dropped from the loss (its loss mask
  zeroed); ``mismatch/mis_masked_frac`` is the fraction of sequences dropped.

Sums (not means) are what ``MismatchSums`` holds, so shards (micro-batches, data-parallel ranks)
merge exactly: ``merge`` adds sums and takes the max of maxima.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class MismatchSums:
    tokens: float = 0.0
    abs_sum: float = 0.0
    abs_max: float = 0.0
    k3_sum: float = 0.0
    capped: float = 0.0
    seqs: float = 0.0
    seqs_masked: float = 0.0

    def merge(self, other: MismatchSums) -> MismatchSums:
        return MismatchSums(
            tokens=self.tokens + other.tokens,
            abs_sum=self.abs_sum + other.abs_sum,
            abs_max=max(self.abs_max, other.abs_max),
            k3_sum=self.k3_sum + other.k3_sum,
            capped=self.capped + other.capped,
            seqs=self.seqs + other.seqs,
            seqs_masked=self.seqs_masked + other.seqs_masked,
        )

    def as_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed fields, max fields) for an all-reduce SUM / MAX across ranks."""
        fields = [self.tokens, self.abs_sum, self.k3_sum, self.capped, self.seqs, self.seqs_masked]
        sums = torch.tensor(fields, dtype=torch.float64)
        return sums, torch.tensor([self.abs_max], dtype=torch.float64)

    @classmethod
    def from_tensors(cls, sums: torch.Tensor, maxes: torch.Tensor) -> MismatchSums:
        t, a, k, c, s, m = (float(x) for x in sums.tolist())
        return cls(tokens=t, abs_sum=a, abs_max=float(maxes[0]), k3_sum=k, capped=c, seqs=s, seqs_masked=m)

    def metrics(self) -> dict[str, float]:
        if self.tokens == 0:
            return {}
        out = {
            "mismatch/abs_mean": self.abs_sum / self.tokens,
            "mismatch/abs_max": self.abs_max,
            "mismatch/k3_kl": self.k3_sum / self.tokens,
            "mismatch/tis_capped_frac": self.capped / self.tokens,
            "mismatch/tokens": self.tokens,
        }
        if self.seqs:
            out["mismatch/mis_masked_frac"] = self.seqs_masked / self.seqs
        return out


def log_ratio(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    """``logp_trainer - logp_rollout`` in float64 (a long sequence sums many small differences)."""
    if trainer_logp.shape != rollout_logp.shape:
        raise ValueError(f"trainer log-probs {tuple(trainer_logp.shape)} and rollout log-probs "
                         f"{tuple(rollout_logp.shape)} differ in shape")
    return trainer_logp.detach().double() - rollout_logp.detach().double()


def token_mismatch(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                   tis_cap: float | None = None) -> MismatchSums:
    """Token statistics of one or more sequences (any shape; ``mask`` selects policy tokens)."""
    sel = mask.reshape(-1) > 0
    d = log_ratio(trainer_logp, rollout_logp).reshape(-1)[sel]
    if d.numel() == 0:
        return MismatchSums()
    capped = float((torch.exp(d) >= tis_cap).sum()) if tis_cap is not None else 0.0
    return MismatchSums(
        tokens=float(d.numel()),
        abs_sum=float(d.abs().sum()),
        abs_max=float(d.abs().max()),
        k3_sum=float((torch.expm1(d) - d).sum()),
        capped=capped,
    )


def sequence_log_ratio(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """``log Π_t ratio_t`` over the sequence's policy tokens."""
    return float((log_ratio(trainer_logp, rollout_logp) * (mask.double() > 0)).sum())


def mis_keeps(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> bool:
    """Sequence-level MIS: True iff the sequence ratio lies in ``[1/cap, cap]`` (cap > 1)."""
    if cap <= 1:
        raise ValueError(f"MIS cap must be > 1 (the kept range is [1/cap, cap]), got {cap}")
    return abs(sequence_log_ratio(trainer_logp, rollout_logp, mask)) <= math.log(cap)
