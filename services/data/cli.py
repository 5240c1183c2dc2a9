"""``retool data dapo | retool-sft | aime``: prepare local files (downloaded by the user)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


def _finish(report) -> None:  # noqa: ANN001 - PrepReport, imported lazily
    typer.echo(report.summary())
    if report.rows_written == 0:
        raise typer.Exit(1)


@app.command("dapo")
def dapo(
    input: Path = typer.Option(..., "--input", "-i", help="DAPO-Math-17k parquet"),
    output: Path = typer.Option(..., "--output", "-o"),
    tool_instruction: bool = typer.Option(False, help="append the code-tool instruction to prompts"),
    dedupe: bool = typer.Option(True, help="drop repeated problems"),
    limit: int | None = typer.Option(None, help="stop after this many output rows"),
) -> None:
    """DAPO-Math-17k → RL training parquet (validated, deduplicated)."""
    # lazy: pyarrow (~0.7 s): each command loads its own preparer, none at CLI start
    from services.data.dapo import prepare_dapo

    _finish(prepare_dapo(input, output, tool_instruction=tool_instruction, dedupe=dedupe, limit=limit))


@app.command("retool-sft")
def retool_sft(
    input: Path = typer.Option(..., "--input", "-i", help="ReTool-SFT parquet"),
    output: Path = typer.Option(..., "--output", "-o"),
    format: str = typer.Option("code", help="code (<code> tags) or hermes (tool calls)"),
    limit: int | None = typer.Option(None),
) -> None:
    """ReTool-SFT traces → multi-turn chat messages."""
    # lazy: pyarrow: see dapo
    from services.data.retool_sft import prepare_retool_sft

    if format not in ("code", "hermes"):
        raise typer.BadParameter("must be 'code' or 'hermes'", param_hint="--format")
    _finish(prepare_retool_sft(input, output, fmt=format, limit=limit))  # type: ignore[arg-type]


@app.command("aime")
def aime(
    input: Path = typer.Option(..., "--input", "-i", help="AIME 2024 or 2025 parquet"),
    output: Path = typer.Option(..., "--output", "-o"),
    source: str | None = typer.Option(None, help="data_source name, e.g. aime_2025 (default: file stem)"),
    tool_instruction: bool = typer.Option(False),
) -> None:
    """AIME rows → validation parquet."""
    # lazy: pyarrow: see dapo
    from services.data.aime import prepare_aime

    _finish(prepare_aime(input, output, data_source=source, tool_instruction=tool_instruction))
