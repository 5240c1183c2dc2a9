"""Hand-computed checks of the trainer's pure RL pieces (advantages, losses, DAPO, metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.algo.advantages import broadcast_to_tokens, gae_advantages, grpo_outcome_advantages
from services.trainer.algo.dapo import (
    BatchAssembler,
    DynamicSamplingExhausted,
    is_informative,
    overlong_penalty,
    tis_weights,
)
from services.trainer.algo.policy_loss import ClipConfig, agg_loss, kl_estimate, policy_loss, value_loss
from services.trainer.algo.validation_metrics import (
    ValSample,
    bootstrap_ks,
    compute_validation_metrics,
    majority_value,
)


def test_grpo_uses_unbiased_std_like_verl():
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    groups = ["a", "a", "a", "a", "b", "b", "c", "d", "d", "d"]
    adv = grpo_outcome_advantages(rewards, groups)
    s = math.sqrt(4 / 3)  # unbiased std of [1,-1,-1,1]; the biased one would be 1.0
    expected = [1 / (s + 1e-6), -1 / (s + 1e-6), -1 / (s + 1e-6), 1 / (s + 1e-6),
                0.0, 0.0,  # all-equal group
                1 / (1 + 1e-6),  # singleton group: mean 0, std 1
                (2 / 3) / (math.sqrt(1 / 3) + 1e-6), (-1 / 3) / (math.sqrt(1 / 3) + 1e-6),
                (-1 / 3) / (math.sqrt(1 / 3) + 1e-6)]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_no_std():
    adv = grpo_outcome_advantages(torch.tensor([1.0, 0.0, 0.0]), [7, 7, 7], norm_by_std=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3], abs=1e-6)


def test_broadcast_only_to_loss_mask():
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 1, 0, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0, 2, 2, 0, 2], [0, 0, -1, 0, 0]]
    with pytest.raises(ValueError, match="loss_mask"):
        broadcast_to_tokens(torch.tensor([1.0]), mask)


def test_gae_skips_masked_interpreter_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.25]])
    mask = torch.tensor([[1, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # t=2: delta = 0.75; t=1 skipped; t=0: delta = 0.9*0.25 - 0.5 = -0.275, gae = -0.275 + 0.72*0.75
    assert adv.tolist()[0] == pytest.approx([0.265, 0.0, 0.75])
    assert ret.tolist()[0] == pytest.approx([0.765, 0.0, 1.0])
    white, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=True)
    m = (0.265 + 0.75) / 2
    sd = math.sqrt(((0.265 - m) ** 2 + (0.75 - m) ** 2) / 1)  # unbiased over 2 masked entries
    assert white.tolist()[0] == pytest.approx([(0.265 - m) / sd, 0.0, (0.75 - m) / sd], abs=1e-4)


def _lp(ratios):
    return torch.log(torch.tensor([ratios]))


def test_policy_loss_asymmetric_and_dual_clip():
    old = torch.zeros(1, 4)
    new = _lp([1.5, 0.5, 1.0, 5.0])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = policy_loss(new, old, adv, torch.ones(1, 4), clip=ClipConfig(0.2, 0.28, 3.0))
    # per token: -1.28 (clipped high), -0.5, 1.0, 3.0 (dual clip caps 5.0 at c=3)
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 + 1.0 + 3.0) / 4, abs=1e-6)
    assert out.metrics["actor/pg_clipfrac"] == pytest.approx(0.25)
    assert out.metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    logs = [math.log(r) for r in (1.5, 0.5, 1.0, 5.0)]
    assert out.metrics["actor/ppo_kl"] == pytest.approx(-sum(logs) / 4, abs=1e-6)
    k3 = sum(r - math.log(r) - 1 for r in (1.5, 0.5, 1.0, 5.0)) / 4
    assert out.metrics["actor/ppo_kl_k3"] == pytest.approx(k3, abs=1e-5)


def test_policy_loss_gradient_zero_when_clipped():
    new = _lp([1.5, 1.1]).requires_grad_(True)
    out = policy_loss(new, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    out.loss.backward()
    assert new.grad[0, 0].item() == 0.0  # ratio 1.5 > 1.28: clipped, no gradient
    assert new.grad[0, 1].item() == pytest.approx(-1.1 / 2)  # d(-A*r)/dlogp = -r, mean over 2


def test_policy_loss_tis_weights_scale_tokens():
    out = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2),
                      is_weights=torch.tensor([[2.0, 0.5]]))
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)


@pytest.mark.parametrize("mode,expected", [("token-mean", 7 / 3), ("seq-mean-token-mean", 2.75),
                                           ("seq-mean-token-sum", 3.5)])
def test_agg_modes_padded_packed_and_split(mode, expected):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected)
    flat, flat_mask = loss.reshape(-1), mask.reshape(-1)
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    assert agg_loss(flat, flat_mask, mode, seq_index=seq, num_seqs=2).item() == pytest.approx(expected)
    # micro-batches with global normalisers sum exactly to the full loss
    parts = [agg_loss(loss[i:i + 1], mask[i:i + 1], mode, num_seqs=2, num_tokens=3) for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(expected)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(loss, mask, "seq-sum")


def test_kl_estimators_and_value_loss():
    lp, ref = torch.tensor([0.5]), torch.tensor([0.0])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-6)
    out = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1),
                     clip_range_value=0.5)
    assert out.loss.item() == pytest.approx(0.5 * 2.25)
    assert out.metrics["critic/vf_clipfrac"] == 1.0
    with pytest.raises(ValueError):
        ClipConfig(clip_ratio_c=1.0)


def test_dynamic_sampling_assembler_reports_drops():
    groups = [[1, 1], [1, -1], [-1, -1], [0, 1], [1, 1], [1, 0]]
    asm: BatchAssembler[list[int]] = BatchAssembler(target_groups=2, rewards_of=lambda g: g)
    batch = asm.fill_from(groups)
    assert batch.groups == [[1, -1], [0, 1]] and batch.pulled == 4 and batch.dropped == 2
    assert not is_informative([0.5, 0.5, 0.5]) and is_informative([0.5, 0.0])
    tight: BatchAssembler[list[int]] = BatchAssembler(target_groups=2, rewards_of=lambda g: g, max_pulled=3)
    with pytest.raises(DynamicSamplingExhausted, match="max_pulled=3"):
        tight.fill_from([[1, 1], [1, 1], [0, 0], [1, 0]])
    unfiltered: BatchAssembler[list[int]] = BatchAssembler(2, lambda g: g, filter_zero_variance=False)
    assert unfiltered.fill_from(groups).groups == [[1, 1], [1, -1]]


def test_overlong_penalty_dapo_formula():
    kw = dict(max_response_len=16384, buffer_len=4096, penalty_factor=1.0)
    assert overlong_penalty(100, **kw) == 0.0
    assert overlong_penalty(12288, **kw) == 0.0
    assert overlong_penalty(14336, **kw) == pytest.approx(-0.5)
    assert overlong_penalty(16384, **kw) == pytest.approx(-1.0)
    assert overlong_penalty(14336, max_response_len=16384, buffer_len=4096, penalty_factor=0.5) == -0.25
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(1, max_response_len=10, buffer_len=0, penalty_factor=1.0)


def test_tis_weights_truncate():
    w = tis_weights(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]), cap=2.0)
    assert w.tolist() == pytest.approx([2.0, math.exp(-1)])


def test_bootstrap_ks_and_majority():
    assert bootstrap_ks(30) == [2, 4, 8, 16, 30]
    assert bootstrap_ks(16) == [2, 4, 8, 16]
    assert bootstrap_ks(1) == []
    assert majority_value(["a", "b", "b", "a", "c"], [1, 0, 0, 1, 0]) == 1  # tie: first seen wins


def _samples(acc_by_problem, src="aime25", turns=2):
    out = []
    for pid, accs in acc_by_problem.items():
        for i, a in enumerate(accs):
            out.append(ValSample(data_source=src, problem_id=pid, acc=a, reward=1.0 if a else -1.0,
                                 pred="42" if a else f"w{i % 2}", num_turns=turns + i))
    return out


def test_validation_metric_names_and_values():
    samples = _samples({"p1": [1, 1, 1, 1], "p2": [0, 0, 0, 0], "p3": [1, 0, 0, 0]})
    m = compute_validation_metrics(samples, n_bootstrap=4000, seed=1)
    assert m["val-core/aime25/acc/mean@4"] == pytest.approx((1 + 0 + 0.25) / 3)
    assert m["val-aux/aime25/reward/mean@4"] == pytest.approx((1 - 1 - 0.5) / 3)
    assert "val-core/aime25/acc/best@4/mean" in m and "val-core/aime25/acc/maj@4/mean" in m
    assert "val-aux/aime25/acc/best@2/mean" in m and "val-aux/aime25/acc/worst@4/mean" in m
    # p3 (p = 1/4): best@2 with replacement = 1 - (3/4)^2 = 0.4375; p1 -> 1, p2 -> 0
    assert m["val-aux/aime25/acc/best@2/mean"] == pytest.approx((1 + 0 + 0.4375) / 3, abs=0.02)
    assert m["val-aux/aime25/acc/worst@2/mean"] == pytest.approx((1 + 0 + 0.0625) / 3, abs=0.02)
    assert m["val-aux/num_turns/min"] == 2 and m["val-aux/num_turns/max"] == 5
    assert m["val-aux/num_turns/mean"] == pytest.approx(3.5)
    again = compute_validation_metrics(samples, n_bootstrap=4000, seed=1)
    assert again == m  # seeded
