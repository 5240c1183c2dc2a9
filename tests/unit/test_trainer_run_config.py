"""`retool trainer run --dry-run`: the resolved config, or one clear error before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _dry_run(tmp_path, text: str, world: int = 1) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "trainer",
            "run",
            "--config",
            str(cfg),
            "--dry-run",
            "--set",
            "trainer.lr=2e-6",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WORLD_SIZE": str(world)},
    )


def test_dry_run_prints_the_resolved_config(tmp_path):
    out = _dry_run(
        tmp_path, "dataset: train.parquet\ntrainer: {batch_prompts: 4, group_size: 4, mini_batch_size: 8}\n"
    )
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["trainer"]["lr"] == 2e-6 and cfg["trainer"]["clip_ratio_high"] == 0.28
    assert cfg["trainer"]["batch_prompts"] == 4 and cfg["prompts_stream"] == "retool:prompts"


def test_sequence_parallel_larger_than_world_is_refused_up_front(tmp_path):
    out = _dry_run(tmp_path, "dataset: x.parquet\ntrainer: {fsdp: {sp_size: 8}}\n", world=2)
    assert out.returncode == 2
    assert "sp_size" in out.stderr and "8" in out.stderr and "world size is 2" in out.stderr


def test_ppo_with_a_critic_is_accepted_and_critic_settings_without_it_are_refused(tmp_path):
    out = _dry_run(tmp_path, "dataset: x.parquet\ntrainer: {algorithm: ppo, critic: {lam: 0.95}}\n")
    assert out.returncode == 0, out.stderr
    critic = json.loads(out.stdout)["trainer"]["critic"]
    assert critic["lam"] == 0.95 and critic["lr"] == 1e-5 and critic["cliprange_value"] == 0.5
    out = _dry_run(tmp_path, "dataset: x.parquet\ntrainer: {critic: {lam: 0.95}}\n")
    assert out.returncode == 2 and "only algorithm=ppo trains a critic" in out.stderr


def test_unknown_key_is_refused(tmp_path):
    out = _dry_run(tmp_path, "dataset: x.parquet\ntrainer: {learning_rate: 1}\n")
    assert out.returncode == 2 and "learning_rate" in out.stderr


def test_planned_steps_never_outrun_the_data(caplog):
    import pytest

    from services.common.config import ConfigError
    from services.trainer.loop import planned_steps

    assert planned_steps(None, prompts=100, epochs=3, batch_prompts=32) == 9  # 300 jobs -> 9 full batches
    assert planned_steps(5, prompts=100, epochs=3, batch_prompts=32) == 5
    with caplog.at_level("WARNING", logger="trainer"):
        assert planned_steps(50, prompts=12, epochs=1, batch_prompts=2) == 6
    assert "max_steps=50 exceeds the 6 steps" in caplog.text
    with pytest.raises(ConfigError, match="batch_prompts=32"):
        planned_steps(10, prompts=10, epochs=3, batch_prompts=32)
