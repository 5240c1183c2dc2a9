"""DAPO pieces: dynamic sampling (drop zero-variance groups), overlong reward shaping, TIS.

Invariants
- A group is informative iff its rewards are not all equal (its GRPO advantages are not all 0).
- ``BatchAssembler`` pulls groups in arrival order and keeps only informative ones (when
  filtering is on) until ``target_groups`` are held; it reports pulled/kept/dropped counts and
  fails with a clear error if ``max_pulled`` groups were consumed without filling the batch.
- Overlong shaping (DAPO / verl ``DAPORewardManager``): with ``expected = max_len - buffer``,
  ``penalty = min(-(len - expected) / buffer * factor, 0)``, i.e. 0 up to ``expected`` tokens,
  falling linearly to ``-factor`` at ``max_len``. It is added to the outcome reward.
- TIS weight = min(exp(old_logp_train - logp_rollout), cap), detached (verl ``tis_imp_ratio_cap``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

G = TypeVar("G")


def is_informative(rewards: Sequence[float], tol: float = 0.0) -> bool:
    """True iff the group's rewards are not all equal (max - min > tol)."""
    if len(rewards) == 0:
        raise ValueError("a group must have at least one reward")
    return (max(rewards) - min(rewards)) > tol


class DynamicSamplingExhausted(RuntimeError):
    """Raised when too many groups were pulled without filling the batch."""


@dataclass
class AssembledBatch(Generic[G]):
    groups: list[G]
    pulled: int
    dropped: int

    @property
    def kept(self) -> int:
        return len(self.groups)


@dataclass
class BatchAssembler(Generic[G]):
    """Accumulates groups until ``target_groups`` are kept; zero-variance groups are dropped."""

    target_groups: int
    rewards_of: Callable[[G], Sequence[float]]
    filter_zero_variance: bool = True
    max_pulled: int | None = None
    _kept: list[G] = field(default_factory=list)
    _pulled: int = 0
    _dropped: int = 0

    def __post_init__(self) -> None:
        if self.target_groups < 1:
            raise ValueError(f"target_groups must be >= 1, got {self.target_groups}")

    @property
    def full(self) -> bool:
        return len(self._kept) >= self.target_groups

    def add(self, group: G) -> bool:
        """Offer one group; returns True if it was kept."""
        if self.full:
            raise RuntimeError("batch already full; call take() first")
        self._pulled += 1
        if self.filter_zero_variance and not is_informative(self.rewards_of(group)):
            self._dropped += 1
            self._check_budget()
            return False
        self._kept.append(group)
        return True

    def _check_budget(self) -> None:
        if self.max_pulled is not None and self._pulled >= self.max_pulled and not self.full:
            raise DynamicSamplingExhausted(
                f"dynamic sampling pulled {self._pulled} groups (max_pulled={self.max_pulled}) but kept only "
                f"{len(self._kept)} of target_groups={self.target_groups}; {self._dropped} had identical "
                "rewards. Raise max_pulled or disable filtering.")

    def take(self) -> AssembledBatch[G]:
        if not self.full:
            raise RuntimeError(f"batch not full: {len(self._kept)}/{self.target_groups} groups")
        out = AssembledBatch(groups=self._kept[: self.target_groups], pulled=self._pulled,
                             dropped=self._dropped)
        self._kept, self._pulled, self._dropped = self._kept[self.target_groups:], 0, 0
        return out

    def fill_from(self, source: Iterable[G]) -> AssembledBatch[G]:
        """Pull from ``source`` until full; raises if the source ends first."""
        it = iter(source)
        while not self.full:
            try:
                group = next(it)
            except StopIteration:
                raise DynamicSamplingExhausted(
                    f"group source ended after {self._pulled} groups with {len(self._kept)} kept of "
                    f"target_groups={self.target_groups}") from None
            self.add(group)
        return self.take()


def overlong_penalty(response_len: int, *, max_response_len: int, buffer_len: int,
                     penalty_factor: float) -> float:
    """DAPO soft overlong punishment (<= 0) for a response of ``response_len`` tokens."""
    if buffer_len <= 0 or buffer_len > max_response_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_response_len={max_response_len}], "
                         f"got {buffer_len}")
    expected = max_response_len - buffer_len
    exceed = response_len - expected
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def tis_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(exp(old - rollout), cap), detached."""
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    with torch.no_grad():
        return torch.clamp(torch.exp(old_log_prob - rollout_log_prob), max=cap)
