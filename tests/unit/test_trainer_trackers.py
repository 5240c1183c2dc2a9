"""Trainer trackers: TensorBoard event files and an offline W&B run receive the step metrics
that the JSONL file receives; a requested tracker that is not installed is a config error."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.trainer.loop import MetricsSink
from services.trainer.trackers import TrackingConfig, open_trackers

STEPS = {
    1: {"actor/pg_loss": 0.25, "critic/score/mean": -0.5},
    2: {"actor/pg_loss": 0.125, "critic/score/mean": 0.75},
}


def _sink(tmp_path: Path, backends: list[str]) -> MetricsSink:
    cfg = TrackingConfig(backends=backends, log_dir=str(tmp_path / "track"), run_name="r1")  # type: ignore[arg-type]
    return MetricsSink(str(tmp_path / "metrics.jsonl"), None, trackers=open_trackers(cfg, {"lr": 1e-6}))


def test_tensorboard_gets_every_step_metric(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = _sink(tmp_path, ["tensorboard"])
    for step, metrics in STEPS.items():
        sink.write(step, metrics)
    sink.close()

    acc = EventAccumulator(str(tmp_path / "track" / "r1"))
    acc.Reload()
    for key in ("actor/pg_loss", "critic/score/mean"):
        events = acc.Scalars(key)
        assert [(e.step, e.value) for e in events] == [(s, m[key]) for s, m in STEPS.items()]
    jsonl = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [1, 2]


def test_wandb_offline_run_records_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = _sink(tmp_path, ["wandb"])
    for step, metrics in STEPS.items():
        sink.write(step, {**metrics, "perf/only_in_wandb_check": float(step)})
    sink.close()

    runs = list((tmp_path / "track" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()
    assert b"perf/only_in_wandb_check" in data and b"actor/pg_loss" in data


def test_missing_tracker_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValidationError, match=r"'wandb' needs the 'wandb' package"):
        TrackingConfig(backends=["tensorboard", "wandb"])  # type: ignore[list-item]
    with pytest.raises(ValidationError, match="backends"):
        TrackingConfig(backends=["mlflow"])  # type: ignore[list-item]
