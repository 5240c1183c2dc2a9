"""Rollouts -> training samples: masks, advantages, overlong shaping, clear errors."""

from __future__ import annotations

import math

import pytest

from services.trainer.batch import Rollout, build_samples
from services.trainer.config import OverlongConfig


def _r(gid, reward, n_resp=4, mask=None, lp=None):
    return Rollout(group_id=gid, prompt_ids=[5, 6, 7], response_ids=list(range(10, 10 + n_resp)),
                   response_loss_mask=mask or [1] * n_resp, reward=reward, rollout_logprobs=lp)


def test_masks_and_advantages_follow_groups():
    rollouts = [_r("g", 1.0, mask=[1, 0, 0, 1], lp=[-0.1, -0.2, -0.3, -0.4]), _r("g", -1.0), _r("h", 1.0),
                _r("h", 1.0)]
    samples, metrics = build_samples(rollouts)
    a = 1 / (math.sqrt(2) + 1e-6)  # [1, -1]: mean 0, unbiased std sqrt(2)
    assert samples[0].input_ids.tolist() == [5, 6, 7, 10, 11, 12, 13]
    assert samples[0].loss_mask.tolist() == [0, 0, 0, 1, 0, 0, 1]
    assert samples[0].advantages.tolist() == pytest.approx([0, 0, 0, a, 0, 0, a])
    assert samples[0].rollout_logprobs.tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, -0.3, -0.4])
    assert samples[1].advantages.tolist() == pytest.approx([0, 0, 0, -a, -a, -a, -a])
    assert samples[2].advantages.abs().max() == 0  # all-equal group
    assert metrics["critic/score/mean"] == 0.5 and metrics["policy_tokens"] == 2 + 4 + 4 + 4


def test_overlong_shaping_changes_rewards_before_advantages():
    rollouts = [_r("g", 1.0, n_resp=8), _r("g", 1.0, n_resp=4)]
    shaping = OverlongConfig(enabled=True, buffer_len=4, penalty_factor=1.0)
    samples, metrics = build_samples(rollouts, overlong=shaping, max_response_len=8)
    # expected = 8 - 4 = 4: the 8-token response gets -(8-4)/4 = -1, the 4-token one 0
    assert metrics["critic/rewards/mean"] == pytest.approx((0.0 + 1.0) / 2)
    assert samples[0].advantages[-1] < 0 < samples[1].advantages[-1]


def test_bad_rollouts_name_the_field():
    with pytest.raises(ValueError, match="rollout 0 .*response_loss_mask has 2 entries"):
        build_samples([_r("g", 1.0, mask=[1, 1])])
    with pytest.raises(ValueError, match="rollout_logprobs has 1 entries"):
        build_samples([_r("g", 1.0, lp=[0.0])])
    with pytest.raises(ValueError, match="max_response_len"):
        build_samples([_r("g", 1.0)], overlong=OverlongConfig(enabled=True))
