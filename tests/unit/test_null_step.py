"""``step_mode=null``: the step packs every micro-batch as training would and touches no weights."""

from __future__ import annotations

import pytest
import torch

from services.common.config import ConfigError
from services.trainer.config import TrainerConfig
from services.trainer.packing import TrainSample
from services.trainer.step import StepSettings, train_step


def _sample(n: int, prompt: int = 3) -> TrainSample:
    mask = torch.zeros(n)
    mask[prompt:] = 1.0
    return TrainSample(input_ids=torch.arange(n) % 50, loss_mask=mask, advantages=mask * 0.5,
                       rollout_logprobs=torch.zeros(n))


def test_null_step_packs_every_token_and_leaves_weights_alone():
    samples = [_sample(10 + i) for i in range(8)]
    settings = StepSettings(mini_batch_size=4, micro_batch_max_tokens=32, step_mode="null")
    model = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = train_step(model, optimizer, samples, settings)
    assert metrics["step_mode=null"] == 1.0
    assert metrics["null/packed_tokens"] == sum(len(s) for s in samples)
    assert metrics["null/micro_batches"] >= 2 * 2  # 4 sequences of 10-17 tokens: 2+ per 32-token budget
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_null_mode_config_errors_are_named():
    with pytest.raises((ConfigError, ValueError), match="step_mode=null"):
        TrainerConfig(step_mode="null", algorithm="ppo")
    with pytest.raises((ConfigError, ValueError), match="null_push_mb"):
        TrainerConfig(null_push_mb=10)
