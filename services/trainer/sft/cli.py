"""``retool sft run``: multi-turn SFT (launch under torchrun for more than one process)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from services.common.cli_config import config_option, dry_run_option, resolve_config, set_option

app = typer.Typer(no_args_is_help=True)


@app.command("run")
def run(
    config: Path = config_option(required=True, help="YAML/JSON SFT config (see configs/sft_*.yaml)"),
    set_: list[str] = set_option("optim.lr=2e-5"),
    dry_run: bool = dry_run_option(),
) -> None:
    """Supervised fine-tuning on multi-turn tool-use traces; ends with a Hugging Face export."""
    # lazy: `retool --help` imports every command module; config models cost ~10-40 ms each
    from services.common.logging import setup_logging
    from services.trainer.sft.config import SFTConfig

    cfg = resolve_config(SFTConfig, config=config, env_prefix="RETOOL_SFT", overrides=set_, dry_run=dry_run,
                         check=lambda c: c.validate_parallel(int(os.environ.get("WORLD_SIZE", "1"))))
    if cfg is None:
        return
    cfg.require_ready()
    from services.trainer.sft.run import run_sft  # lazy: torch (~2.5 s), not at CLI start

    setup_logging("INFO")
    out = run_sft(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        typer.echo(f"exported {out}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # everything is written; skip gloo's teardown, which sometimes aborts after a complete run
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
