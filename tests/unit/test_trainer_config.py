"""Trainer config: defaults are the reference run; impossible settings are named clearly."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.trainer.config import TrainerConfig


def test_defaults_are_reference_run():
    cfg = TrainerConfig()
    assert (cfg.batch_prompts, cfg.group_size, cfg.mini_batch_size) == (32, 16, 64)
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.lr) == (0.2, 0.28, 1e-6)
    assert (cfg.save_freq, cfg.test_freq, cfg.loss_agg_mode) == (30, 5, "token-mean")
    assert cfg.validate_parallel(8) == (8, 1)


def test_sequence_parallel_larger_than_world_is_named():
    cfg = load_config(TrainerConfig, overrides=["fsdp.sp_size=8"])
    with pytest.raises(ConfigError, match=r"sp_size \(sequence_parallel_size\)=8 but world size is 2"):
        cfg.validate_parallel(2)


def test_other_parallel_mismatches():
    with pytest.raises(ConfigError, match="dp_size × fsdp.sp_size = 3 × 1 = 3 but world size is 2"):
        load_config(TrainerConfig, overrides=["fsdp.dp_size=3"]).validate_parallel(2)
    with pytest.raises(ConfigError, match="not divisible by data-parallel size 3"):
        load_config(TrainerConfig, overrides=["mini_batch_size=64"]).validate_parallel(3)


def test_impossible_batch_shapes_name_fields():
    with pytest.raises(ConfigError, match="mini_batch_size"):
        load_config(TrainerConfig, overrides=["mini_batch_size=48"])
    with pytest.raises(ConfigError, match="micro_batch_max_tokens"):
        load_config(TrainerConfig, overrides=["micro_batch_max_tokens=1024"])
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        load_config(TrainerConfig, overrides=["clip_ratio_c=1.0"])
    with pytest.raises(ConfigError, match="unknown_key|extra"):
        load_config(TrainerConfig, overrides=["unknown_key=1"])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only error path")
def test_cpu_offload_without_accelerator_is_a_config_error():
    from services.trainer.actor import Actor, tiny_qwen2
    from services.trainer.config import FSDPConfig
    from services.trainer.fsdp import apply_fsdp2

    with pytest.raises(ConfigError, match="cpu_offload"):
        apply_fsdp2(Actor(tiny_qwen2()), FSDPConfig(cpu_offload=True))
