"""Single-process training step: packing, micro-batching and old-log-prob handling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.step import StepSettings, recompute_logprobs, train_step
from tests.integration.test_trainer_fsdp import make_samples


def _run(settings: StepSettings, samples=None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    actor = Actor(tiny_qwen2(seed=5), chunk_tokens=16)
    opt = torch.optim.SGD(actor.parameters(), lr=0.1)
    metrics = train_step(actor, opt, samples or make_samples(), settings)
    return {k: v.detach().clone() for k, v in actor.named_parameters()}, metrics


BASE = StepSettings(mini_batch_size=8, micro_batch_max_tokens=48, loss_agg_mode="token-mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_update_independent_of_packing_and_micro_batch_budget(mode):
    ref, _ = _run(replace(BASE, loss_agg_mode=mode, micro_batch_max_tokens=1000))  # one micro-batch
    packed, _ = _run(replace(BASE, loss_agg_mode=mode))  # several packed micro-batches
    padded, _ = _run(replace(BASE, loss_agg_mode=mode, use_packing=False))
    fixed, _ = _run(replace(BASE, loss_agg_mode=mode, use_packing=False, padded_micro_batch_size=3))
    for name in ref:
        torch.testing.assert_close(packed[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(padded[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(fixed[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_on_policy_first_step_has_unit_ratio_and_no_clipping():
    _, metrics = _run(BASE)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/optimizer_steps"] == 1
    assert metrics["actor/entropy"] > 0


def test_recompute_fills_old_logprobs_and_without_it_rollout_logprobs_are_used():
    actor = Actor(tiny_qwen2(seed=5))
    filled = recompute_logprobs(actor, make_samples(), BASE)
    assert all(s.old_logprobs is not None and s.old_logprobs[0] == 0 for s in filled)
    _, metrics = _run(replace(BASE, recompute_old_logprobs=False))
    assert abs(metrics["actor/ppo_kl"]) > 0.1  # rollout log-probs are random, far from the model's
    with pytest.raises(ValueError, match="multiple of mini_batch_size=8"):
        _run(BASE, samples=make_samples()[:5])


def test_kl_loss_pulls_towards_reference_and_needs_ref_logprobs():
    actor = Actor(tiny_qwen2(seed=5), chunk_tokens=16)
    with_ref = [replace(s, ref_logprobs=lp) for s, lp in
                zip(make_samples(), [s.old_logprobs for s in recompute_logprobs(actor, make_samples(), BASE)],
                    strict=True)]
    # reference == current policy: the k3 KL term is exactly 0 before the update
    _, metrics = _run(replace(BASE, kl_coef=0.5), samples=with_ref)
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _run(replace(BASE, kl_coef=0.5))
