"""``retool sandbox ...`` commands."""

from __future__ import annotations

from pathlib import Path

import typer

from services.common.cli_config import config_option, dry_run_option, resolve_config, set_option

app = typer.Typer(no_args_is_help=True)


@app.command("serve")
def serve(
    host: str | None = typer.Option(None, help="bind address"),
    port: int | None = typer.Option(None, help="bind port"),
    config: Path | None = config_option(),
    set_: list[str] = set_option("max_concurrency=64"),
    dry_run: bool = dry_run_option(),
) -> None:
    """Start the SandboxFusion-compatible sandbox service."""
    # lazy: `retool --help` imports every command module; config models cost ~10-40 ms each
    from services.sandbox.config import SandboxConfig

    cfg = resolve_config(SandboxConfig, config=config, env_prefix="RETOOL_SANDBOX", overrides=set_,
                         values={"host": host, "port": port}, dry_run=dry_run)
    if cfg is None:
        return
    # lazy: the server imports uvicorn and fastapi (~1 s): not at CLI start
    from services.sandbox.server import run_server

    run_server(cfg)
