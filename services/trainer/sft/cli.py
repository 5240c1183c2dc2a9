"""``retool sft run``: multi-turn SFT (launch under torchrun for more than one process)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("run")
def run(
    config: Path = typer.Option(..., "--config", "-c", help="YAML/JSON SFT config (see configs/sft_*.yaml)"),
    set_: list[str] = typer.Option([], "--set", help="override, e.g. --set optim.lr=2e-5"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved, validated config and exit"),
) -> None:
    """Supervised fine-tuning on multi-turn tool-use traces; ends with a Hugging Face export."""
    import json
    import os
    import sys

    from services.common.config import load_config
    from services.common.logging import setup_logging
    from services.trainer.sft.config import SFTConfig

    cfg = load_config(SFTConfig, file=config, env_prefix="RETOOL_SFT", overrides=set_)
    cfg.validate_parallel(int(os.environ.get("WORLD_SIZE", "1")))
    if dry_run:
        typer.echo(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return
    cfg.require_ready()
    from services.trainer.sft.run import run_sft

    setup_logging("INFO")
    out = run_sft(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        typer.echo(f"exported {out}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # everything is written; skip gloo's teardown, which sometimes aborts after a complete run
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
