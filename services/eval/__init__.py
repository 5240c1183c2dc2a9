"""``retool eval``: accuracy (mean/best/worst/maj@k), turns and tool use of a model on a parquet.

See services/eval/run.py for the phases and outputs. Cheap to import (typer only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from services.common.config import load_config


def eval_command(
    model: Path | None = typer.Option(None, "--model",
                                       help="HF model dir; sandbox/reward/rollout start locally"),
    data: Path | None = typer.Option(None, "--data", help="parquet (retool data aime / dapo output)"),
    n: int | None = typer.Option(None, "--n", help="responses per prompt (default 30)"),
    rollout_url: list[str] = typer.Option([], "--rollout-url", help="running rollout replica (repeatable)"),
    out: Path | None = typer.Option(None, "--out", help="output dir (report.json, report.md, PNGs)"),
    limit: int | None = typer.Option(None, "--limit", help="only the first LIMIT prompts"),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML/JSON EvalConfig file"),
    set_: list[str] = typer.Option([], "--set", help="override, e.g. --set temperature=0.6"),
) -> None:
    # lazy: the evaluation and the local stack import numpy, httpx, pyarrow: not at CLI start
    from services.eval.run import EvalConfig, evaluate
    from services.stack.local import run_interruptible

    given = {"model": str(model) if model else None, "data": str(data) if data else None, "n": n,
             "rollout_urls": rollout_url or None, "out_dir": str(out) if out else None, "limit": limit}
    values = {k: v for k, v in given.items() if v is not None}
    cfg = load_config(EvalConfig, file=config, env_prefix="RETOOL_EVAL", values=values, overrides=set_)
    report = run_interruptible(lambda: evaluate(cfg))
    core = {k: v for k, v in report.metrics.items() if k.startswith(("val-core/", "val-aux/num_turns"))}
    print(json.dumps({"metrics": core, "summary": report.summary.model_dump()}, indent=2))
    print(f"report in {cfg.out_dir}: report.json, report.md, samples.jsonl, accuracy_at_k.png, "
          "distributions.png", file=sys.stderr)
