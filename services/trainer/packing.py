"""Padding-free packing of variable-length sequences into micro-batches.

Invariants
- A packed micro-batch is ONE row: the sequences concatenated, ``position_ids`` restarting at 0
  for each sequence, no pad token anywhere (every position computed is a real token).
  transformers >= 5 detects the sequence boundaries from ``position_ids`` (when no 2-D attention
  mask and no cache are given) and builds a block-diagonal causal mask for sdpa/eager/flex, so
  tokens never attend across sequences (proved by tests/unit/test_trainer_packing.py).
- Per-token tensors are aligned with tokens: index t holds the value for token t (its log-prob
  is predicted from position t-1). The first token of every sequence is a prompt token and must
  have loss mask 0, so the cross-boundary prediction at a sequence start never reaches the loss.
- ``plan_micro_batches`` puts every sequence in exactly one micro-batch whose total tokens stay
  within the budget (first-fit decreasing); ``split_into`` balances a fixed number of bins
  (longest-processing-time greedy) so every data-parallel rank runs the same number of
  micro-batches (FSDP collectives need that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


@dataclass
class TrainSample:
    """One response, ready for the loss. All tensors are 1-D with ``len(input_ids)`` entries."""

    input_ids: torch.Tensor  # long: prompt + response (interpreter tokens included)
    loss_mask: torch.Tensor  # float/bool: 1 on policy tokens only
    advantages: torch.Tensor  # float: per-token advantage (0 off the mask)
    old_logprobs: torch.Tensor | None = None  # behaviour-policy log-probs as seen by the trainer
    rollout_logprobs: torch.Tensor | None = None  # log-probs reported by the rollout engine
    ref_logprobs: torch.Tensor | None = None  # reference-policy log-probs (only for the KL loss)
    reward: float | None = None  # shaped outcome reward of the response (read by the PPO/GAE step)

    def __post_init__(self) -> None:
        n = self.input_ids.numel()
        for name in ("loss_mask", "advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is not None and t.numel() != n:
                raise ValueError(f"{name} has {t.numel()} entries but input_ids has {n}")
        if n < 2:
            raise ValueError("a sample needs at least one prompt token and one response token")
        if float(self.loss_mask[0]) != 0.0:
            raise ValueError("loss_mask[0] must be 0: the first token is a prompt token")

    def __len__(self) -> int:
        return self.input_ids.numel()


@dataclass
class MicroBatch:
    """Model inputs plus per-token training tensors; ``[1, N]`` when packed, ``[B, L]`` when padded."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # None when packed
    seq_index: torch.Tensor  # same shape as input_ids: local sequence id of every position
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    num_seqs: int
    packed: bool

    @property
    def computed_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with every tensor on ``device`` (itself when already there)."""
        if self.input_ids.device == device:
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return replace(self, input_ids=self.input_ids.to(device), position_ids=self.position_ids.to(device),
                       attention_mask=move(self.attention_mask), seq_index=self.seq_index.to(device),
                       loss_mask=self.loss_mask.to(device), advantages=self.advantages.to(device),
                       old_logprobs=move(self.old_logprobs), rollout_logprobs=move(self.rollout_logprobs),
                       ref_logprobs=move(self.ref_logprobs))


def _cat(parts: Sequence[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor | None:
    if any(p is None for p in parts):
        return None
    return torch.cat([p.to(dtype) for p in parts if p is not None]).unsqueeze(0)


def pack(samples: Sequence[TrainSample]) -> MicroBatch:
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    ids = torch.cat([s.input_ids.long() for s in samples]).unsqueeze(0)
    pos = torch.cat([torch.arange(len(s)) for s in samples]).unsqueeze(0)
    seq = torch.cat([torch.full((len(s),), i, dtype=torch.long) for i, s in enumerate(samples)]).unsqueeze(0)
    return MicroBatch(
        input_ids=ids, position_ids=pos, attention_mask=None, seq_index=seq,
        loss_mask=_cat([s.loss_mask for s in samples], torch.float32),
        advantages=_cat([s.advantages for s in samples], torch.float32),
        old_logprobs=_cat([s.old_logprobs for s in samples], torch.float32),
        rollout_logprobs=_cat([s.rollout_logprobs for s in samples], torch.float32),
        ref_logprobs=_cat([s.ref_logprobs for s in samples], torch.float32),
        num_seqs=len(samples), packed=True)


def _pad_stack(parts: Sequence[torch.Tensor | None], length: int, dtype: torch.dtype) -> torch.Tensor | None:
    if any(p is None for p in parts):
        return None
    out = torch.zeros(len(parts), length, dtype=dtype)
    for i, p in enumerate(parts):
        assert p is not None
        out[i, : p.numel()] = p.to(dtype)
    return out


def pad(samples: Sequence[TrainSample], pad_token_id: int = 0, pad_to: int | None = None) -> MicroBatch:
    """Right-padded ``[B, L]`` batch, L = longest sample or ``pad_to`` (a fixed-shape batch)."""
    if not samples:
        raise ValueError("cannot pad an empty list of samples")
    length = max(len(s) for s in samples)
    if pad_to is not None:
        if pad_to < length:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest sample ({length} tokens)")
        length = pad_to
    ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    attn = torch.zeros(len(samples), length, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = s.input_ids
        attn[i, : len(s)] = 1
    pos = torch.arange(length).unsqueeze(0).expand(len(samples), -1).clone()
    seq = torch.arange(len(samples)).unsqueeze(-1).expand(-1, length).clone()
    mask = _pad_stack([s.loss_mask for s in samples], length, torch.float32)
    assert mask is not None
    adv = _pad_stack([s.advantages for s in samples], length, torch.float32)
    assert adv is not None
    return MicroBatch(
        input_ids=ids, position_ids=pos, attention_mask=attn, seq_index=seq, loss_mask=mask, advantages=adv,
        old_logprobs=_pad_stack([s.old_logprobs for s in samples], length, torch.float32),
        rollout_logprobs=_pad_stack([s.rollout_logprobs for s in samples], length, torch.float32),
        ref_logprobs=_pad_stack([s.ref_logprobs for s in samples], length, torch.float32),
        num_seqs=len(samples), packed=False)


def _check_fits(lengths: Sequence[int], max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"micro_batch_max_tokens must be >= 1, got {max_tokens}")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sequence {i} has {n} tokens > micro_batch_max_tokens={max_tokens}; raise the "
                             "budget to at least the longest prompt+response")


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: indices grouped into bins of at most ``max_tokens`` tokens."""
    _check_fits(lengths, max_tokens)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def split_into(lengths: Sequence[int], k: int, max_tokens: int | None = None) -> list[list[int]] | None:
    """Balance indices over exactly ``k`` bins (LPT); None if the budget cannot be met that way."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in order:
        b = min(range(k), key=lambda j: (loads[j], j))
        if max_tokens is not None and loads[b] + lengths[i] > max_tokens:
            return None
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def shard_for_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Token-balanced assignment of a mini-batch's sequences to data-parallel ranks."""
    out = split_into(lengths, world_size)
    assert out is not None
    return out


def plan_equal_micro_batches(rank_lengths: Sequence[Sequence[int]], max_tokens: int) -> list[list[list[int]]]:
    """Per rank, the same number of micro-batches (some possibly empty), each within ``max_tokens``."""
    for lens in rank_lengths:
        _check_fits(lens, max_tokens)
    k = max(max(len(plan_micro_batches(lens, max_tokens)) for lens in rank_lengths), 1)
    while True:
        plans = [split_into(lens, k, max_tokens) for lens in rank_lengths]
        if all(p is not None for p in plans):
            return [p for p in plans if p is not None]
        k += 1
