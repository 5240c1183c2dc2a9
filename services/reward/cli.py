"""``retool reward serve | grade``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from services.common.cli_config import config_option, dry_run_option, resolve_config, set_option

app = typer.Typer(no_args_is_help=True)


@app.command("serve")
def serve(
    host: str | None = typer.Option(None),
    port: int | None = typer.Option(None),
    config: Path | None = config_option(),
    set_: list[str] = set_option("timeout_s=1"),
    dry_run: bool = dry_run_option(),
) -> None:
    """Start the reward HTTP service."""
    # lazy: `retool --help` imports every command module; config models cost ~10-40 ms each
    from services.reward.config import RewardConfig

    cfg = resolve_config(RewardConfig, config=config, env_prefix="RETOOL_REWARD", overrides=set_,
                         values={"host": host, "port": port}, dry_run=dry_run)
    if cfg is None:
        return
    # lazy: uvicorn and the app (fastapi, sympy: seconds) load when serving, not at CLI start
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
    config: Path | None = config_option(),
    set_: list[str] = set_option("timeout_s=1"),
) -> None:
    """Grade one response from the shell; prints the JSON result."""
    # lazy: the config and the grader (asyncio: ~80 ms) are not needed at CLI start
    import asyncio

    from services.reward.config import RewardConfig
    from services.reward.grader import Grader
    from services.reward.scoring import score

    cfg = resolve_config(RewardConfig, config=config, env_prefix="RETOOL_REWARD", overrides=set_)
    assert cfg is not None  # no --dry-run here

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
