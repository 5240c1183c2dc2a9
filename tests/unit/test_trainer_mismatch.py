"""Rollout–trainer mismatch metrics, token TIS capping and sequence-level MIS, against values
computed by hand (the numbers in the comments), and their effect inside a real training step."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.algo.mismatch import MismatchSums, mis_keeps, token_mismatch
from services.trainer.config import TrainerConfig
from services.trainer.packing import TrainSample
from services.trainer.step import StepSettings, measure_and_correct, train_step
from tests.integration.test_trainer_fsdp import make_samples

TRAINER = torch.tensor([-1.0, -0.5, -2.0, -9.0])
ROLLOUT = torch.tensor([-1.2, -0.5, -1.0, -0.1])
MASK = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last token is an interpreter token: ignored
# d = trainer - rollout on the policy tokens = [0.2, 0.0, -1.0]


def test_token_statistics_match_hand_computed_values():
    m = token_mismatch(TRAINER, ROLLOUT, MASK, tis_cap=1.2).metrics()
    assert m["mismatch/tokens"] == 3
    assert m["mismatch/abs_mean"] == pytest.approx((0.2 + 0.0 + 1.0) / 3)
    assert m["mismatch/abs_max"] == pytest.approx(1.0)
    # k3 = exp(d) - 1 - d: 0.0214027582 + 0 + 0.3678794412
    assert m["mismatch/k3_kl"] == pytest.approx((0.0214027582 + 0.3678794412) / 3, abs=1e-7)  # float32 inputs
    # ratios 1.2214, 1, 0.3679: only the first reaches the cap 1.2
    assert m["mismatch/tis_capped_frac"] == pytest.approx(1 / 3)
    assert "mismatch/mis_masked_frac" not in m


def test_identical_log_probs_have_zero_mismatch_and_no_tokens_no_metrics():
    m = token_mismatch(TRAINER, TRAINER, MASK, tis_cap=2.0).metrics()
    assert (m["mismatch/abs_mean"], m["mismatch/abs_max"], m["mismatch/k3_kl"],
            m["mismatch/tis_capped_frac"]) == (0.0, 0.0, 0.0, 0.0)
    assert token_mismatch(TRAINER, ROLLOUT, torch.zeros(4)).metrics() == {}
    with pytest.raises(ValueError, match="differ in shape"):
        token_mismatch(TRAINER, ROLLOUT[:3], MASK)


def test_shards_merge_to_the_whole():
    whole = token_mismatch(TRAINER, ROLLOUT, MASK, tis_cap=1.2)
    parts = [token_mismatch(TRAINER[i:i + 1], ROLLOUT[i:i + 1], MASK[i:i + 1], tis_cap=1.2) for i in range(4)]
    merged = MismatchSums()
    for p in parts:
        merged = merged.merge(p)
    assert merged.metrics() == pytest.approx(whole.metrics())
    total, maxes = merged.as_tensors()
    assert MismatchSums.from_tensors(total, maxes).metrics() == pytest.approx(whole.metrics())


def test_sequence_mis_keeps_the_ratio_range_one_over_c_to_c():
    # sequence log-ratio = 0.2 + 0 - 1.0 = -0.8: ratio exp(-0.8) = 0.4493
    assert not mis_keeps(TRAINER, ROLLOUT, MASK, cap=2.0)  # 0.4493 < 1/2
    assert mis_keeps(TRAINER, ROLLOUT, MASK, cap=3.0)  # 1/3 <= 0.4493 <= 3
    assert mis_keeps(TRAINER, ROLLOUT, MASK, cap=math.exp(0.8) + 1e-9)  # the boundary is kept
    assert not mis_keeps(ROLLOUT, TRAINER, MASK, cap=2.0)  # ratio 2.2255 > 2
    with pytest.raises(ValueError, match="cap must be > 1"):
        mis_keeps(TRAINER, ROLLOUT, MASK, cap=1.0)


def _sample(trainer: torch.Tensor, rollout: torch.Tensor) -> TrainSample:
    """One prompt token (mask 0, log-prob 0) then the four tokens above."""
    mask = torch.cat([torch.zeros(1), MASK])
    return TrainSample(input_ids=torch.arange(5), loss_mask=mask, advantages=mask.clone(),
                       old_logprobs=torch.cat([torch.zeros(1), trainer]),
                       rollout_logprobs=torch.cat([torch.zeros(1), rollout]))


def test_measure_and_correct_drops_exactly_the_out_of_range_sequences():
    settings = StepSettings(mini_batch_size=2, micro_batch_max_tokens=64, tis_cap=1.2, mis_cap=2.0)
    far, near = _sample(TRAINER, ROLLOUT), _sample(TRAINER, TRAINER + 0.1)  # near: ratio exp(-0.3)
    out, m = measure_and_correct([far, near], settings)
    assert out[0].loss_mask.sum() == 0 and out[0].advantages.abs().sum() == 0
    assert out[1] is near
    assert m["mismatch/mis_masked_frac"] == 0.5
    assert m["mismatch/tokens"] == 6  # measured before masking: both sequences count
    assert m["mismatch/abs_max"] == pytest.approx(1.0)
    no_mis, m2 = measure_and_correct([far, near], replace(settings, mis_cap=None, tis_cap=None))
    assert no_mis[0] is far and "mismatch/mis_masked_frac" not in m2 and "mismatch/tis_capped_frac" not in m2


def test_mis_config_is_an_option_beside_token_tis():
    cfg = TrainerConfig(mis={"enabled": True, "cap": 1.5}, tis={"enabled": True, "cap": 2.0})
    s = StepSettings.from_config(cfg)
    assert (s.mis_cap, s.tis_cap) == (1.5, 2.0)
    assert StepSettings.from_config(TrainerConfig()).mis_cap is None
    with pytest.raises(ValueError, match="greater than 1"):
        TrainerConfig(mis={"enabled": True, "cap": 1.0})


def test_a_training_step_reports_the_mismatch_and_survives_masking_every_sequence():
    base = StepSettings(mini_batch_size=8, micro_batch_max_tokens=48)
    actor = Actor(tiny_qwen2(seed=5), chunk_tokens=16)
    before = {k: v.detach().clone() for k, v in actor.named_parameters()}
    opt = torch.optim.SGD(actor.parameters(), lr=0.1)
    # make_samples' rollout log-probs are random, far from the model: every sequence leaves [1/1.01, 1.01]
    metrics = train_step(actor, opt, make_samples(), replace(base, mis_cap=1.01))
    assert metrics["mismatch/mis_masked_frac"] == 1.0
    assert metrics["mismatch/abs_mean"] > 0.1 and metrics["mismatch/k3_kl"] > 0
    assert all(math.isfinite(v) for v in metrics.values())
    for k, v in actor.named_parameters():  # nothing left to learn from (weight decay off in SGD)
        torch.testing.assert_close(v.detach(), before[k], msg=k)
    plain = train_step(Actor(tiny_qwen2(seed=5), chunk_tokens=16), opt, make_samples(), base)
    assert plain["mismatch/abs_mean"] == pytest.approx(metrics["mismatch/abs_mean"], rel=1e-5)
