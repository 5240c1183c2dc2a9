"""Optional experiment trackers for the trainer's step metrics: TensorBoard and Weights & Biases.

Invariants:
- trackers only ever receive what the JSONL metrics file receives (same step, same keys), on rank 0;
- a requested tracker whose package is missing is a config error before the first step, naming the
  tracker and the package to install (``pip install -e ".[tracking]"``); nothing is silently dropped;
- ``close()`` returns once every tracker's data is written (W&B: its service process has shut down);
- W&B runs in whatever mode ``WANDB_MODE`` says (``offline`` needs no account or network); its API
  key is read by wandb from the environment and never logged here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field, field_validator

from services.common.config import StrictModel

TrackerName = Literal["tensorboard", "wandb"]


class TrackingConfig(StrictModel):
    backends: list[TrackerName] = Field(default_factory=list, description="e.g. [tensorboard, wandb]")
    log_dir: str = Field("runs/trainer/tb", description="TensorBoard event files / W&B run files")
    project: str = Field("retool", description="W&B project")
    run_name: str | None = Field(None, description="W&B / TensorBoard run name (default: generated)")

    @field_validator("backends")
    @classmethod
    def _installed(cls, backends: list[TrackerName]) -> list[TrackerName]:
        """A requested tracker must be importable: caught by ``--dry-run``, before any model loads."""
        for name in backends:
            if importlib.util.find_spec(name) is None:
                raise MissingTracker(name, name)
        return backends


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, cfg: TrackingConfig) -> None:
        try:
            # lazy: TensorBoard is optional (tracking.backends); loaded only when chosen
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MissingTracker("tensorboard", "tensorboard") from exc
        log_dir = Path(cfg.log_dir) / cfg.run_name if cfg.run_name else Path(cfg.log_dir)
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg: TrackingConfig, config: dict[str, Any]) -> None:
        try:
            # lazy: wandb is an optional package, loaded only when tracking.backends names it
            import wandb
        except ImportError as exc:
            raise MissingTracker("wandb", "wandb") from exc
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, name=cfg.run_name, dir=cfg.log_dir, config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the run and wait until wandb's service process has written (or uploaded) it.

        ``run.finish()`` only informs that process; the data is complete once it shuts down, which
        wandb otherwise waits for in an atexit hook that a multi-process trainer skips (``os._exit``).
        """
        # lazy: wandb is optional (see WandbTracker)
        import wandb

        self.run.finish()
        wandb.teardown()


class MissingTracker(ValueError):
    def __init__(self, tracker: str, package: str) -> None:
        super().__init__(
            f"tracking.backends: {tracker!r} needs the {package!r} package "
            f"(pip install {package}, or pip install -e \".[tracking]\")"
        )


def open_trackers(cfg: TrackingConfig, run_config: dict[str, Any] | None = None) -> list[Tracker]:
    """Every configured tracker, opened; raises ``MissingTracker`` (a config error) up front."""
    out: list[Tracker] = []
    for name in dict.fromkeys(cfg.backends):  # a backend named twice is opened once
        out.append(TensorBoardTracker(cfg) if name == "tensorboard" else WandbTracker(cfg, run_config or {}))
    return out
