"""``retool model ...``: build models locally (nothing can be downloaded from a hub here)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("init-tiny")
def init_tiny(
    out: Path = typer.Option(..., "--out", help="output directory (Hugging Face format)"),
    size: str = typer.Option("tiny", help="tiny (tests, demo) | small | bench (~526 MB fp32)"),
    seed: int = typer.Option(0, help="weight initialisation seed"),
) -> None:
    """Write a randomly initialised Qwen2-architecture model and its byte-level BPE tokenizer."""
    from services.common.config import ConfigError
    from services.rollout.model_init import PRESETS, init_model_dir

    if size not in PRESETS:
        raise ConfigError(f"size: {size!r} is not one of {sorted(PRESETS)}")
    path = init_model_dir(out, size, seed)  # type: ignore[arg-type]
    typer.echo(f"wrote {size} model (seed {seed}) to {path}")
