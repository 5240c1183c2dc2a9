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


def test_unwired_ppo_is_refused_not_silently_trained_as_grpo(tmp_path):
    out = _dry_run(tmp_path, "dataset: x.parquet\ntrainer: {algorithm: ppo}\n")
    assert out.returncode == 2 and "trainer.algorithm='ppo'" in out.stderr


def test_unknown_key_is_refused(tmp_path):
    out = _dry_run(tmp_path, "dataset: x.parquet\ntrainer: {learning_rate: 1}\n")
    assert out.returncode == 2 and "learning_rate" in out.stderr
