"""``retool demo``: the README's main job — a tiny model learns, by GRPO, to use the code tool.

See services/demo/pipeline.py for the phases and artifacts. Cheap to import (typer only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from services.common.config import load_config


def run(
    out: Path | None = typer.Option(None, "--out", help="output directory (report.json, plot, logs); "
                                    "default runs/demo, runs/demo-recovery for --task recovery, each "
                                    "+ -qwen2.5 with --tokenizer qwen2.5"),
    task: str = typer.Option("multiply", "--task", help="multiply: learn to use the code tool; recovery: "
                             "learn to read an interpreter error and fix the code (multi-turn)"),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="demo (default): the demo model's digit-level 512-token tokenizer; "
        "qwen2.5: the real Qwen2.5 tokenizer and chat template, 151,936 tied embedding rows (each SFT "
        "step ~10x slower; 600 SFT steps: the full demo takes ~40 min on 2 cores; docs/qwen-tokenizer.md); "
        "default output directory gets a -qwen2.5 suffix"),
    quick: bool = typer.Option(False, "--quick", help="shortened demo (the CI end-to-end test's settings)"),
    seed: int = typer.Option(0, help="seed of data, model, SFT, sampling and training"),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML/JSON DemoConfig file"),
    set_: list[str] = typer.Option([], "--set", help="override, e.g. --set grpo.steps=20"),
) -> None:
    # lazy: the demo's pipeline and the local stack import numpy, httpx, pyarrow: not at CLI start
    from services.demo.pipeline import Demo, DemoConfig, demo_values
    from services.stack.local import run_interruptible

    values = demo_values(task=task, tokenizer=tokenizer, quick=quick, seed=seed, out=out)
    cfg = load_config(DemoConfig, file=config, env_prefix="RETOOL_DEMO", values=values, overrides=set_)
    out = Path(cfg.out_dir)
    report = run_interruptible(Demo(cfg).run)
    keys = ("before", "after", "steps", "wall_seconds", "phase_seconds", "trained_multi_call_responses")
    summary = {k: report[k] for k in keys if k in report}
    print(json.dumps(summary, indent=2))
    print(f"artifacts in {out}: report.json, metrics.jsonl, progress.png, logs/", file=sys.stderr)
