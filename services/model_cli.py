"""``retool model ...``: build models locally (nothing can be downloaded from a hub here)."""

from __future__ import annotations

from pathlib import Path

import typer

from services.common.config import ConfigError

app = typer.Typer(no_args_is_help=True)


@app.command("init-tiny")
def init_tiny(
    out: Path = typer.Option(..., "--out", help="output directory (Hugging Face format)"),
    size: str | None = typer.Option(None, help="tiny (tests, demo; the default) | mini (the default "
                                    "with --tokenizer qwen2.5: head_dim 32 for vLLM) | small | bench"),
    seed: int = typer.Option(0, help="weight initialisation seed"),
    tokenizer: str = typer.Option("local", help="local: a small BPE trained here | qwen2.5: the real Qwen2.5 "
                                  "tokenizer and Instruct chat template (151,936 embedding rows), offline"),
    tie: bool | None = typer.Option(None, "--tie/--untie", help="tie lm_head to the embedding (default: the "
                                    "preset's; untied with qwen2.5, as in Qwen2.5-7B/32B)"),
) -> None:
    """Write a randomly initialised Qwen2-architecture model and its byte-level BPE tokenizer."""
    # lazy: the factory imports the chat templates (~20 ms): not at CLI start
    from services.models.tiny import PRESETS, TOKENIZERS, init_model_dir

    size = size or ("mini" if tokenizer == "qwen2.5" else "tiny")
    if size not in PRESETS:
        raise ConfigError(f"size: {size!r} is not one of {sorted(PRESETS)}")
    if tokenizer not in TOKENIZERS:
        raise ConfigError(f"tokenizer: {tokenizer!r} is not one of {list(TOKENIZERS)}")
    path = init_model_dir(out, size, seed, tokenizer=tokenizer, tie_word_embeddings=tie)  # type: ignore[arg-type]
    typer.echo(f"wrote {size} model (seed {seed}, tokenizer {tokenizer}) to {path}")
