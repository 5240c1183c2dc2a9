"""``retool rollout serve | push-weights``.

The weight-push token is read from an environment variable or a file whose *name* is given on the
command line; it is never a CLI value (it would show in ``ps``) and never logged.
"""

from __future__ import annotations

from pathlib import Path

import typer

from services.common.cli_config import config_option, dry_run_option, resolve_config, set_option

app = typer.Typer(no_args_is_help=True)


@app.command("serve")
def serve(
    model: Path | None = typer.Option(None, help="model directory (weights + tokenizer)"),
    host: str | None = typer.Option(None, help="bind address"),
    port: int | None = typer.Option(None, help="HTTP port"),
    grpc_port: int | None = typer.Option(None, help="weight-push gRPC port (needs a token)"),
    sandbox_url: str | None = typer.Option(None, help="sandbox service, e.g. http://127.0.0.1:8080"),
    reward_url: str | None = typer.Option(None, help="reward service; unset = responses are not scored"),
    redis_url: str | None = typer.Option(None, help="consume prompt jobs from Redis (worker on)"),
    tool_format: str | None = typer.Option(None, help="code | hermes"),
    weight_token_env: str | None = typer.Option(None, help="NAME of the env var holding the weight token"),
    weight_token_file: Path | None = typer.Option(None, help="file holding the weight token"),
    config: Path | None = config_option(),
    set_: list[str] = set_option("agent.max_turns=4"),
    dry_run: bool = dry_run_option(),
) -> None:
    """Start the rollout service (HTTP API, optional Redis worker and gRPC weight push)."""
    # lazy: the config names the Redis client's types (redis, ~1 s of import): not at CLI start
    from services.rollout.config import RolloutConfig

    values: dict[str, object] = {
        "model": str(model) if model else None,
        "host": host,
        "port": port,
        "grpc_port": grpc_port,
        "sandbox_url": sandbox_url,
        "reward_url": reward_url,
        "weight_token_env": weight_token_env,
        "weight_token_file": str(weight_token_file) if weight_token_file else None,
    }
    if redis_url:
        values["redis"] = {"url": redis_url}
    if tool_format:
        values["agent"] = {"tool_format": tool_format}
    cfg = resolve_config(RolloutConfig, config=config, env_prefix="RETOOL_ROLLOUT", overrides=set_,
                         values=values, dry_run=dry_run)
    if cfg is None:
        return
    from services.rollout.runtime import run_server  # lazy: see RolloutConfig above

    run_server(cfg)


@app.command("push-weights")
def push_weights(
    checkpoint: Path = typer.Option(..., help="checkpoint directory (safetensors)"),
    target: list[str] = typer.Option(..., help="rollout replica gRPC address host:port (repeatable)"),
    version: int | None = typer.Option(None, help="policy version to announce"),
    token_env: str = typer.Option("RETOOL_WEIGHT_TOKEN", help="NAME of the env var holding the token"),
    token_file: Path | None = typer.Option(None, help="file holding the token (instead of the env var)"),
    ca_file: Path | None = typer.Option(None, help="push over TLS: the CA of the replicas' certificates"),
    cert_file: Path | None = typer.Option(None, help="client certificate (replicas requiring mutual TLS)"),
    key_file: Path | None = typer.Option(None, help="client private key (with --cert-file)"),
    server_name: str | None = typer.Option(None, help="name the replicas' certificates carry (e.g. rollout)"),
) -> None:
    """Stream a checkpoint's weights to rollout replicas over gRPC (TLS with --ca-file)."""
    # lazy: ssl (TLS files) and the runtime, which imports the rollout config (redis, see serve)
    from services.common.security import TLSClientFiles
    from services.rollout.runtime import push_weights as do_push

    tls = None
    if ca_file is not None:
        tls = TLSClientFiles(ca_file=str(ca_file), cert_file=str(cert_file) if cert_file else None,
                             key_file=str(key_file) if key_file else None, server_name=server_name)
    elif cert_file or key_file or server_name:
        raise typer.BadParameter("needs --ca-file (TLS)", param_hint="--cert-file/--key-file/--server-name")
    do_push(checkpoint, target, version=version, token_env=token_env, token_file=token_file, tls=tls)
