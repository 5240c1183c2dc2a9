"""``retool demo``: the README's main job — a tiny model learns, by GRPO, to use the code tool.

See services/demo/pipeline.py for the phases and artifacts. Cheap to import (typer only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer


def run(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="output directory (report.json, plot, logs)"),
    quick: bool = typer.Option(False, "--quick", help="shortened demo (the CI end-to-end test's settings)"),
    seed: int = typer.Option(0, help="seed of data, model, SFT, sampling and training"),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML/JSON DemoConfig file"),
    set_: list[str] = typer.Option([], "--set", help="override, e.g. --set grpo.steps=20"),
) -> None:
    from services.common.config import load_config
    from services.demo.pipeline import QUICK, Demo, DemoConfig
    from services.stack.local import run_interruptible

    values = {**(QUICK if quick else {}), "out_dir": str(out), "seed": seed}
    cfg = load_config(DemoConfig, file=config, env_prefix="RETOOL_DEMO", values=values, overrides=set_)
    report = run_interruptible(Demo(cfg).run)
    summary = {k: report[k] for k in ("before", "after", "steps", "wall_seconds")}
    print(json.dumps(summary, indent=2))
    print(f"artifacts in {out}: report.json, metrics.jsonl, progress.png, logs/", file=sys.stderr)
