"""``retool sandbox ...`` commands."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("serve")
def serve(
    host: str | None = typer.Option(None, help="bind address"),
    port: int | None = typer.Option(None, help="bind port"),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML/JSON config file"),
    set_: list[str] = typer.Option([], "--set", help="override, e.g. --set max_concurrency=64"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved, validated config and exit"),
) -> None:
    """Start the SandboxFusion-compatible sandbox service."""
    from services.common.config import dump_config, load_config
    from services.sandbox.config import SandboxConfig

    cfg = load_config(SandboxConfig, file=config, env_prefix="RETOOL_SANDBOX",
                      values={"host": host, "port": port}, overrides=set_)
    if dry_run:
        typer.echo(dump_config(cfg))
        return
    from services.sandbox.server import run_server

    run_server(cfg)
