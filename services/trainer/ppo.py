"""One PPO step with a critic: values -> GAE advantages/returns -> critic update + actor update.

Invariants
- Values are computed without gradients, each rank for its own shard with the same plan as the
  actor's old-log-prob recompute (every rank runs the same number of forwards), then summed over
  ranks: each sample is computed by exactly one rank and the others add zeros, so every rank holds
  all values and computes identical GAE, whitening and metrics.
- ``values[:, t]`` is V(state before token t), aligned like the actor's log-probs; the shaped
  outcome reward (``TrainSample.reward``) sits on the last loss-mask-1 token; GAE skips mask-0
  tokens (prompt, interpreter output), carrying the bootstrap across them.
- The critic update uses the same mini-batches and micro-batch plan as the actor; every
  micro-batch loss is normalised by the mini-batch's global token / sequence counts and multiplied
  by the data-parallel size (FSDP averages gradients), so FSDP on N ranks == one process
  (tests/integration/test_trainer_ppo_fsdp.py).
- The actor update is ``step.train_step`` unchanged: it already takes per-token advantages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from services.trainer.algo.advantages import gae_advantages
from services.trainer.algo.policy_loss import value_loss
from services.trainer.config import CriticConfig
from services.trainer.packing import MicroBatch, TrainSample
from services.trainer.step import (
    DPInfo,
    StepSettings,
    _grad_norm_and_clip,
    _local_micro_batches,
    _minibatches,
    _split_back,
    all_reduce,
    train_step,
)


@dataclass(frozen=True)
class CriticSettings:
    cliprange_value: float = 0.5
    vf_coef: float = 1.0
    grad_clip: float = 1.0
    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = True

    @classmethod
    def from_config(cls, cfg: CriticConfig) -> CriticSettings:
        return cls(cliprange_value=cfg.cliprange_value, vf_coef=cfg.vf_coef, grad_clip=cfg.grad_clip,
                   gamma=cfg.gamma, lam=cfg.lam, whiten_advantages=cfg.whiten_advantages)


def _all_reduce_sum(t: torch.Tensor, dp: DPInfo) -> torch.Tensor:
    return all_reduce(t, dp)


def _padded(parts: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    out = torch.zeros(len(parts), length, dtype=torch.float32)
    for i, p in enumerate(parts):
        out[i, : p.numel()] = p.float()
    return out


def _layout(parts: Sequence[torch.Tensor], mb: MicroBatch) -> torch.Tensor:
    """Per-sample 1-D tensors in the micro-batch's layout (packed row or padded rows)."""
    if mb.packed:
        return torch.cat([p.float() for p in parts]).unsqueeze(0)
    return _padded(parts, mb.input_ids.shape[1])


@torch.no_grad()
def compute_values(critic: nn.Module, samples: Sequence[TrainSample], settings: StepSettings,
                   dp: DPInfo = DPInfo()) -> torch.Tensor:
    """``[N, max_len]`` values of all samples (right-padded with 0), identical on every rank."""
    local: dict[int, torch.Tensor] = {}
    for start, minibatch, _ in _minibatches(samples, settings):
        for micro, mb in _local_micro_batches(minibatch, settings, dp):
            values = critic(mb.input_ids, mb.position_ids, mb.attention_mask)
            if not micro:  # placeholder: keeps FSDP collectives aligned
                continue
            for i, v in zip(micro, _split_back(values, mb, [minibatch[i] for i in micro]), strict=True):
                local[start + i] = v.detach().float().cpu()
    table = torch.zeros(len(samples), max(len(s) for s in samples))
    for i, v in local.items():
        table[i, : v.numel()] = v
    return _all_reduce_sum(table, dp)


def outcome_token_rewards(samples: Sequence[TrainSample], length: int) -> torch.Tensor:
    """``[N, length]``: each sample's reward on its last loss-mask-1 token, 0 elsewhere."""
    out = torch.zeros(len(samples), length)
    for i, s in enumerate(samples):
        if s.reward is None:
            raise ValueError(f"sample {i} has no reward: the ppo step needs TrainSample.reward")
        policy = s.loss_mask.nonzero().reshape(-1)
        if policy.numel():
            out[i, int(policy[-1])] = float(s.reward)
    return out


def critic_update(critic: nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[TrainSample],
                  old_values: torch.Tensor, returns: torch.Tensor, settings: StepSettings,
                  csettings: CriticSettings, dp: DPInfo = DPInfo()) -> dict[str, float]:
    """ppo_epochs × mini-batches of the clipped value loss; ``old_values``/``returns`` are ``[N, T]``."""
    totals = torch.zeros(4, dtype=torch.float64)  # Σ mini-batch vf_loss, Σ clipped, Σ vpred, Σ tokens
    grad_norms: list[float] = []
    for _ in range(settings.ppo_epochs):
        for start, minibatch, num_tokens in _minibatches(samples, settings):
            optimizer.zero_grad(set_to_none=True)
            for micro, mb in _local_micro_batches(minibatch, settings, dp):
                vpred = critic(mb.input_ids, mb.position_ids, mb.attention_mask)
                if not micro:  # placeholder: a zero-weighted pass keeps FSDP collectives aligned
                    (vpred.sum() * 0.0).backward()
                    continue
                dev = vpred.device
                old = _layout([old_values[start + i, : len(minibatch[i])] for i in micro], mb).to(dev)
                ret = _layout([returns[start + i, : len(minibatch[i])] for i in micro], mb).to(dev)
                mask = mb.loss_mask.to(dev)
                out = value_loss(vpred, old, ret, mask, clip_range_value=csettings.cliprange_value,
                                 agg_mode=settings.loss_agg_mode, seq_index=mb.seq_index.to(dev),
                                 num_seqs=len(minibatch), num_tokens=num_tokens)
                (out.loss * csettings.vf_coef * dp.world).backward()
                n_local = float(mask.sum())
                totals += torch.tensor([float(out.loss.detach()), out.metrics["critic/vf_clipfrac"] * n_local,
                                        out.metrics["critic/vpred_mean"] * n_local, n_local],
                                       dtype=torch.float64)
            grad_norms.append(_grad_norm_and_clip(critic, csettings.grad_clip))
            optimizer.step()
    totals = _all_reduce_sum(totals, dp)
    tokens = max(float(totals[3]), 1.0)
    return {"critic/vf_loss": float(totals[0]) / len(grad_norms),
            "critic/vf_clipfrac": float(totals[1]) / tokens,
            "critic/vpred_mean": float(totals[2]) / tokens,
            "critic/grad_norm": sum(grad_norms) / len(grad_norms),
            "critic/optimizer_steps": float(len(grad_norms))}


def _masked_stats(x: torch.Tensor, mask: torch.Tensor, name: str) -> dict[str, float]:
    sel = x[mask > 0]
    if sel.numel() == 0:
        return {}
    return {f"{name}/mean": float(sel.mean()), f"{name}/max": float(sel.max()),
            f"{name}/min": float(sel.min())}


def ppo_train_step(actor: nn.Module, actor_optimizer: torch.optim.Optimizer, critic: nn.Module,
                   critic_optimizer: torch.optim.Optimizer, samples: Sequence[TrainSample],
                   settings: StepSettings, csettings: CriticSettings, dp: DPInfo = DPInfo(), *,
                   update_actor: bool = True) -> dict[str, float]:
    """Values, GAE, the critic update, then (unless ``update_actor`` is False: critic warm-up) the actor's."""
    if len(samples) == 0 or len(samples) % settings.mini_batch_size:
        raise ValueError(f"got {len(samples)} samples; must be a positive multiple of mini_batch_size="
                         f"{settings.mini_batch_size}")
    values = compute_values(critic, samples, settings, dp)
    length = values.shape[1]
    mask = _padded([s.loss_mask for s in samples], length)
    adv, returns = gae_advantages(outcome_token_rewards(samples, length), values, mask, gamma=csettings.gamma,
                                  lam=csettings.lam, whiten=csettings.whiten_advantages)
    metrics = {**_masked_stats(adv, mask, "critic/advantages"),
               **_masked_stats(returns, mask, "critic/returns"),
               **_masked_stats(values, mask, "critic/values")}
    sel = mask > 0
    var_ret = returns[sel].var(unbiased=False) if sel.sum() > 0 else torch.tensor(0.0)
    if var_ret > 0:  # verl's critic/vf_explained_var, before the update
        residual = (returns[sel] - values[sel]).var(unbiased=False)
        metrics["critic/vf_explained_var"] = float(1 - residual / var_ret)
    metrics.update(critic_update(critic, critic_optimizer, samples, values, returns, settings, csettings, dp))
    if update_actor:
        with_adv = [replace(s, advantages=adv[i, : len(s)].clone()) for i, s in enumerate(samples)]
        metrics.update(train_step(actor, actor_optimizer, with_adv, settings, dp))
    return metrics
