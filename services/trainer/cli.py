"""``retool trainer run | export``."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("run")
def run(
    config: Path = typer.Option(..., "--config", "-c", help="YAML/JSON run config"),
    set_: list[str] = typer.Option([], "--set", help="override, e.g. --set trainer.lr=1e-6"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved, validated config and exit"),
) -> None:
    """Run RL training (launch under torchrun for more than one process)."""
    import asyncio
    import json
    import os
    import sys

    from services.common.config import load_config
    from services.common.logging import setup_logging
    from services.trainer.loop import RunConfig, Trainer

    cfg = load_config(RunConfig, file=config, env_prefix="RETOOL_TRAINER", overrides=set_)
    cfg.trainer.validate_parallel(int(os.environ.get("WORLD_SIZE", "1")))
    if dry_run:
        typer.echo(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return
    setup_logging("INFO")
    steps = asyncio.run(Trainer(cfg).run())
    typer.echo(f"trained to step {steps}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Work, checkpoints and metrics are all written. Skip the interpreter's teardown: with
        # gloo it sometimes aborts ("terminate called without an active exception") after a
        # complete run, and torchrun would report the run as failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@app.command("export")
def export(
    checkpoint: Path = typer.Option(..., help="checkpoint directory (step_XXXXXXXX)"),
    model: Path = typer.Option(..., help="the Hugging Face model the run started from"),
    out: Path = typer.Option(..., help="output Hugging Face directory"),
) -> None:
    """Write a Hugging Face model from a training checkpoint (the rollout service loads it)."""
    from services.trainer.export import export_hf

    typer.echo(f"wrote {export_hf(checkpoint, model, out)}")
