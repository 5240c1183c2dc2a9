"""One RL training step: (optional) old-log-prob recompute, then ppo_epochs × mini-batches of
gradient-accumulated micro-batches, grad clipping and an optimizer step per mini-batch.

Invariants
- The gradient of a mini-batch does not depend on how it is cut into micro-batches or
  data-parallel shards: every micro-batch loss is normalised by the *mini-batch's* global token /
  sequence counts (``agg_loss`` with explicit normalisers), and the loss is multiplied by the
  data-parallel size because FSDP averages gradients over ranks. Hence FSDP on N ranks ==
  one process on the same data (tests/integration/test_trainer_fsdp.py).
- Every rank runs the same number of forward/backward passes per mini-batch (empty micro-batches
  run a zero-weighted dummy pass), so FSDP collectives always line up.
- All ranks receive the same sample list and pick their shard deterministically.
- Micro-batches are moved to the model's device (the GPU under NCCL); what a step hands back
  (recomputed log-probs, metrics) lives on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from services.trainer.algo.dapo import tis_weights
from services.trainer.algo.mismatch import MismatchSums, mis_keeps, token_mismatch
from services.trainer.algo.policy_loss import AggMode, ClipConfig, KLKind, agg_loss, kl_estimate, policy_loss
from services.trainer.config import TrainerConfig
from services.trainer.packing import (
    MicroBatch,
    TrainSample,
    pack,
    pad,
    plan_equal_micro_batches,
    shard_for_ranks,
)


@dataclass(frozen=True)
class StepSettings:
    mini_batch_size: int
    micro_batch_max_tokens: int
    ppo_epochs: int = 1
    use_packing: bool = True
    padded_micro_batch_size: int | None = None  # padded mode only: fixed sequences per micro-batch
    pad_to_length: int | None = None  # padded mode only: fixed row width (verl without padding removal)
    loss_agg_mode: AggMode = "token-mean"
    clip: ClipConfig = ClipConfig()
    entropy_coeff: float = 0.0
    grad_clip: float = 1.0
    tis_cap: float | None = None
    mis_cap: float | None = None  # sequence-level MIS: drop sequences whose ratio leaves [1/C, C]
    kl_coef: float = 0.0  # > 0: add coef × KL(π || π_ref) (estimator ``kl_kind``) to the loss
    kl_kind: KLKind = "k3"
    recompute_old_logprobs: bool = True
    step_mode: str = "train"  # "null": pack every micro-batch, skip forward and backward (null_step)

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> StepSettings:
        return cls(mini_batch_size=cfg.mini_batch_size, micro_batch_max_tokens=cfg.micro_batch_max_tokens,
                   ppo_epochs=cfg.ppo_epochs, use_packing=cfg.use_packing, loss_agg_mode=cfg.loss_agg_mode,
                   padded_micro_batch_size=cfg.padded_micro_batch_size,
                   clip=ClipConfig(cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c),
                   entropy_coeff=cfg.entropy_coeff, grad_clip=cfg.grad_clip,
                   tis_cap=cfg.tis.cap if cfg.tis.enabled else None,
                   mis_cap=cfg.mis.cap if cfg.mis.enabled else None,
                   kl_coef=cfg.kl.coef if cfg.kl.use_kl_loss else 0.0, kl_kind=cfg.kl.kind,
                   recompute_old_logprobs=cfg.recompute_old_logprobs, step_mode=cfg.step_mode)


@dataclass(frozen=True)
class DPInfo:
    rank: int = 0
    world: int = 1


def _local_plan(minibatch: Sequence[TrainSample], settings: StepSettings, dp: DPInfo) -> list[list[int]]:
    """Indices (into ``minibatch``) of this rank's micro-batches; same count on every rank."""
    lengths = [len(s) for s in minibatch]
    if not settings.use_packing and settings.padded_micro_batch_size is not None:
        # baseline layout (verl without padding removal): contiguous shards, fixed-size chunks
        per_rank = -(-len(minibatch) // dp.world)
        mine = list(range(dp.rank * per_rank, min((dp.rank + 1) * per_rank, len(minibatch))))
        k = settings.padded_micro_batch_size
        chunks = [mine[i:i + k] for i in range(0, len(mine), k)]
        return chunks + [[] for _ in range(-(-per_rank // k) - len(chunks))]
    shards = shard_for_ranks(lengths, dp.world)
    plans = plan_equal_micro_batches([[lengths[i] for i in shard] for shard in shards],
                                     settings.micro_batch_max_tokens)
    mine = shards[dp.rank]
    return [[mine[j] for j in micro] for micro in plans[dp.rank]]


def _collate(samples: Sequence[TrainSample], settings: StepSettings) -> MicroBatch:
    return pack(samples) if settings.use_packing else pad(samples, pad_to=settings.pad_to_length)


def _minibatches(samples: Sequence[TrainSample], settings: StepSettings
                 ) -> Iterator[tuple[int, Sequence[TrainSample], float]]:
    """``(start, minibatch, its loss-mask token count)`` for each mini-batch of one pass, in order."""
    mbs = settings.mini_batch_size
    for start in range(0, len(samples), mbs):
        minibatch = samples[start:start + mbs]
        # max(.., 1): MIS may have dropped every sequence of the mini-batch (then the loss is 0)
        yield start, minibatch, max(float(sum(float(s.loss_mask.sum()) for s in minibatch)), 1.0)


def model_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes (its first parameter's device; FSDP-sharded parameters included)."""
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def all_reduce(t: torch.Tensor, dp: DPInfo, op: Any = None) -> torch.Tensor:
    """``t`` reduced over the data-parallel ranks (NCCL reduces on the GPU: a round trip there), on
    ``t``'s own device; ``t`` itself on one rank."""
    if dp.world == 1 or not dist.is_initialized():
        return t
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    buf = t.to(dev)
    dist.all_reduce(buf, op=op if op is not None else dist.ReduceOp.SUM)
    return buf.to(t.device)


def _local_micro_batches(minibatch: Sequence[TrainSample], settings: StepSettings, dp: DPInfo,
                         device: torch.device | None = None) -> Iterator[tuple[list[int], MicroBatch]]:
    """This rank's micro-batches of ``minibatch``: (indices into it, collated samples, on ``device``).

    Empty indices mark a placeholder (collated from ``minibatch[0]``): the caller runs its forward
    (and a zero-weighted backward when training) and ignores the output, so every rank runs the
    same number of passes and FSDP collectives line up.
    """
    for micro in _local_plan(minibatch, settings, dp):
        mb = _collate([minibatch[i] for i in micro] or [minibatch[0]], settings)
        yield micro, mb.to(device) if device is not None else mb


def _forward(actor: nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    # the LM head on loss-mask positions only (0 elsewhere): every use of the log-probs and entropy
    # (loss, metrics, mismatch, MIS) is masked by the same loss mask
    return actor(mb.input_ids, mb.position_ids, mb.attention_mask, mb.loss_mask > 0)


def _split_back(values: torch.Tensor, mb: MicroBatch, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
    if mb.packed:
        parts = [p.clone() for p in torch.split(values[0], [len(s) for s in samples])]
        for p in parts:  # position 0 was predicted across the packing boundary: not a real log-prob
            p[0] = 0.0
        return parts
    return [values[i, : len(s)].clone() for i, s in enumerate(samples)]


@torch.no_grad()
def recompute_logprobs(actor: nn.Module, samples: Sequence[TrainSample], settings: StepSettings,
                       dp: DPInfo = DPInfo()) -> list[TrainSample]:
    """Samples with ``old_logprobs`` from the current weights (computed for this rank's shard only;
    other ranks' samples are returned unchanged)."""
    out = list(samples)
    device = model_device(actor)
    for start, minibatch, _ in _minibatches(samples, settings):
        for micro, mb in _local_micro_batches(minibatch, settings, dp, device):
            lp, _ = _forward(actor, mb)
            if not micro:
                continue
            for i, values in zip(micro, _split_back(lp, mb, [minibatch[i] for i in micro]), strict=True):
                out[start + i] = replace(minibatch[i], old_logprobs=values.detach().cpu())
    return out


def _grad_norm_and_clip(actor: nn.Module, max_norm: float) -> float:
    params = [p for p in actor.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def measure_and_correct(samples: Sequence[TrainSample], settings: StepSettings, dp: DPInfo = DPInfo()
                        ) -> tuple[list[TrainSample], dict[str, float]]:
    """Rollout–trainer mismatch of the step (``algo/mismatch.py``) and sequence-level MIS.

    Each rank measures the samples whose ``old_logprobs`` it recomputed (its shard); sums, maxima
    and the MIS verdicts are all-reduced, so every rank zeroes the loss mask of the same dropped
    sequences and the mini-batch normalisers stay equal on all ranks. Without recomputed
    ``old_logprobs`` (or rollout log-probs) there is nothing to compare: no metrics, no masking.
    """
    sums = MismatchSums()
    drop = torch.zeros(len(samples), dtype=torch.float64)
    for i, s in enumerate(samples):
        if s.old_logprobs is None or s.rollout_logprobs is None:
            continue
        sums = sums.merge(token_mismatch(s.old_logprobs, s.rollout_logprobs, s.loss_mask, settings.tis_cap))
        if settings.mis_cap is not None and s.loss_mask.sum() > 0:
            sums.seqs += 1
            if not mis_keeps(s.old_logprobs, s.rollout_logprobs, s.loss_mask, settings.mis_cap):
                drop[i] = 1.0
                sums.seqs_masked += 1
    if dp.world > 1 and dist.is_initialized():
        total, maxes = sums.as_tensors()
        total, maxes = all_reduce(total, dp), all_reduce(maxes, dp, dist.ReduceOp.MAX)
        drop = all_reduce(drop, dp)
        sums = MismatchSums.from_tensors(total, maxes)
    metrics = sums.metrics()
    if settings.tis_cap is None:
        metrics.pop("mismatch/tis_capped_frac", None)
    out = [replace(s, loss_mask=torch.zeros_like(s.loss_mask), advantages=torch.zeros_like(s.advantages))
           if drop[i] > 0 else s for i, s in enumerate(samples)]
    return out, metrics


def null_step(samples: Sequence[TrainSample], settings: StepSettings, dp: DPInfo = DPInfo()
              ) -> dict[str, float]:
    """``step_mode=null``: this rank's micro-batches of every mini-batch are planned and packed into
    tensors exactly as a training step packs them; no forward, no backward, no optimizer step."""
    tokens = micro = 0
    start = time.perf_counter()
    for _ in range(settings.ppo_epochs):
        for _, minibatch, _ in _minibatches(samples, settings):
            for indices, mb in _local_micro_batches(minibatch, settings, dp):
                if indices:
                    tokens += int(mb.input_ids.numel())
                    micro += 1
    return {"step_mode=null": 1.0, "null/packed_tokens": float(tokens), "null/micro_batches": float(micro),
            "null/pack_seconds": time.perf_counter() - start}


def train_step(actor: nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[TrainSample],
               settings: StepSettings, dp: DPInfo = DPInfo()) -> dict[str, float]:
    """Run one full step over ``samples`` (len must be a multiple of mini_batch_size); with
    ``step_mode=null`` only the packing (``null_step``)."""
    if len(samples) == 0 or len(samples) % settings.mini_batch_size:
        raise ValueError(f"got {len(samples)} samples; must be a positive multiple of mini_batch_size="
                         f"{settings.mini_batch_size}")
    if settings.step_mode == "null":
        return null_step(samples, settings, dp)
    if settings.recompute_old_logprobs:
        samples = recompute_logprobs(actor, samples, settings, dp)
    samples, mismatch = measure_and_correct(samples, settings, dp)
    sums: dict[str, float] = {}
    count = 0
    grad_norms: list[float] = []
    device = model_device(actor)
    for _ in range(settings.ppo_epochs):
        for _, minibatch, num_tokens in _minibatches(samples, settings):
            optimizer.zero_grad(set_to_none=True)
            for micro, mb in _local_micro_batches(minibatch, settings, dp, device):
                lp, ent = _forward(actor, mb)
                if not micro:  # placeholder: a zero-weighted pass keeps FSDP collectives aligned
                    (lp.sum() * 0.0).backward()
                    continue
                old = mb.old_logprobs if mb.old_logprobs is not None else mb.rollout_logprobs
                if old is None:
                    raise ValueError("samples carry neither old_logprobs nor rollout_logprobs; enable "
                                     "recompute_old_logprobs")
                weights = None
                if settings.tis_cap is not None:
                    if mb.rollout_logprobs is None:
                        raise ValueError("tis is enabled but samples carry no rollout_logprobs")
                    weights = tis_weights(old, mb.rollout_logprobs, settings.tis_cap)
                out = policy_loss(lp, old, mb.advantages, mb.loss_mask, clip=settings.clip,
                                  agg_mode=settings.loss_agg_mode, is_weights=weights, entropy=ent,
                                  seq_index=mb.seq_index, num_seqs=len(minibatch), num_tokens=num_tokens)
                loss = out.loss
                if settings.entropy_coeff > 0:
                    loss = loss - settings.entropy_coeff * agg_loss(
                        ent, mb.loss_mask, settings.loss_agg_mode, seq_index=mb.seq_index,
                        num_seqs=len(minibatch), num_tokens=num_tokens)
                if settings.kl_coef > 0:
                    if mb.ref_logprobs is None:
                        raise ValueError("kl loss is enabled but samples carry no ref_logprobs")
                    kl = agg_loss(kl_estimate(lp, mb.ref_logprobs, settings.kl_kind), mb.loss_mask,
                                  settings.loss_agg_mode, seq_index=mb.seq_index, num_seqs=len(minibatch),
                                  num_tokens=num_tokens)
                    loss = loss + settings.kl_coef * kl
                    out.metrics["actor/kl_loss"] = float(kl.detach())
                (loss * dp.world).backward()
                out.metrics["actor/pg_loss"] = float(out.loss.detach())
                for k, v in out.metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
            grad_norms.append(_grad_norm_and_clip(actor, settings.grad_clip))
            optimizer.step()
    metrics = {k: v / max(count, 1) for k, v in sums.items()}
    metrics.update(mismatch)
    metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["actor/optimizer_steps"] = float(len(grad_norms))
    return metrics
