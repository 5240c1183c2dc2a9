"""``retool reward serve | grade``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


def _config(config: Path | None, overrides: list[str], **values: object):  # noqa: ANN202
    from services.common.config import load_config
    from services.reward.config import RewardConfig

    return load_config(
        RewardConfig, file=config, env_prefix="RETOOL_REWARD", values=values, overrides=overrides
    )


@app.command("serve")
def serve(
    host: str | None = typer.Option(None),
    port: int | None = typer.Option(None),
    config: Path | None = typer.Option(None, "--config", "-c"),
    set_: list[str] = typer.Option([], "--set", help="override, e.g. --set timeout_s=1"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved, validated config and exit"),
) -> None:
    """Start the reward HTTP service."""
    cfg = _config(config, set_, host=host, port=port)
    if dry_run:
        from services.common.config import dump_config

        typer.echo(dump_config(cfg))
        return
    import uvicorn

    from services.common.logging import setup_logging
    from services.reward.app import create_app

    setup_logging(cfg.log_level)
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_config=None, access_log=False,
                **cfg.security.uvicorn_kwargs())


@app.command("grade")
def grade(
    response: str = typer.Option(..., help="model response text"),
    ground_truth: str = typer.Option(..., help="reference answer"),
    num_tool_calls: int = typer.Option(0),
    config: Path | None = typer.Option(None, "--config", "-c"),
    set_: list[str] = typer.Option([], "--set"),
) -> None:
    """Grade one response from the shell; prints the JSON result."""
    import asyncio

    from services.reward.grader import Grader
    from services.reward.scoring import score

    cfg = _config(config, set_)

    async def run() -> dict[str, object]:
        grader = Grader(1, cfg.timeout_s, cfg.max_answer_chars, cfg.max_queue)
        await grader.start()
        try:
            verdict = await grader.grade(response, ground_truth)
        finally:
            await grader.stop()
        value, shaping = score(verdict, num_tool_calls, cfg)
        return {
            "score": value,
            "correct": verdict.correct,
            "extracted": verdict.extracted,
            "reason": verdict.reason,
            "shaping": shaping,
        }

    typer.echo(json.dumps(asyncio.run(run())))
