"""Process-level wiring of the rollout service: load the engine and tokenizer, start uvicorn;
the client side of ``push-weights``.

Invariant: the weight token is read from the env var / file named in the config and passed on
in memory only; it is never logged or put on a command line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from services.common.config import ConfigError
from services.common.logging import get_logger, setup_logging
from services.common.security import TLSClientFiles, read_secret
from services.rollout.config import RolloutConfig, read_weight_token
from services.rollout.engine.options import check_engine_kwargs

log = get_logger("rollout")
_TARGET = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


def load_engine(cfg: RolloutConfig) -> tuple[Any, Any]:
    """(engine, tokenizer) for ``cfg.model`` with the configured backend."""
    if not cfg.model:
        raise ConfigError("model: a model directory is required (--model DIR)")
    if not Path(cfg.model).is_dir():
        raise ConfigError(f"model: {cfg.model} is not a directory")

    check_engine_kwargs(cfg.engine, cfg.engine_kwargs)  # before any engine starts
    if cfg.engine == "hf":
        # lazy: each engine imports torch (and its own stack): only the chosen one loads
        from services.rollout.engine.hf import HFEngine

        try:
            engine = HFEngine(cfg.model, **cfg.engine_kwargs)
        except (TypeError, AttributeError) as exc:  # e.g. engine_kwargs.dtype=float33
            raise ConfigError(f"engine_kwargs: {exc}") from exc
        return engine, engine.tokenizer
    if cfg.engine == "synthetic":
        # lazy: torch: see hf above
        from services.rollout.engine.synthetic import SyntheticEngine

        engine = SyntheticEngine(cfg.model, **cfg.engine_kwargs)
        return engine, engine.tokenizer
    # lazy: torch and vLLM: see hf above
    from services.rollout.engine.vllm_engine import VLLMEngine

    engine = VLLMEngine(cfg.model, **cfg.engine_kwargs)
    return engine, engine.tokenizer


def _weight_server_factory() -> Any:
    try:
        # lazy: torch and grpc: only with grpc_port set
        from services.rollout.weights.server import start_weight_server
    except ImportError:
        return None
    return start_weight_server


def run_server(cfg: RolloutConfig) -> None:
    # lazy: uvicorn and the app (torch) load when serving, not at CLI start
    from services.rollout.server import create_app
    from services.rollout.shutdown import serve_draining

    setup_logging(cfg.log_level)
    token = read_weight_token(cfg)
    factory = None
    if cfg.grpc_port is not None:
        if not token:
            raise ConfigError(
                f"grpc_port: the weight-push server needs a token in the env var {cfg.weight_token_env!r} "
                "or in weight_token_file"
            )
        factory = _weight_server_factory()
        if factory is None:
            raise ConfigError("grpc_port: the weight-push server (services.rollout.weights) is not available")
    engine, tokenizer = load_engine(cfg)
    log.info(
        "starting rollout",
        extra={
            "host": cfg.host,
            "port": cfg.port,
            "grpc_port": cfg.grpc_port,
            "model": cfg.model,
            "tool_format": cfg.agent.tool_format,
            "redis": bool(cfg.redis.url),
        },
    )
    app = create_app(cfg, engine, tokenizer, weight_token=token, weight_server_factory=factory)
    serve_draining(app, host=cfg.host, port=cfg.port, log_config=None, access_log=False,
                   **cfg.security.uvicorn_kwargs())


def push_weights(
    checkpoint: Path, targets: list[str], *, version: int | None, token_env: str, token_file: Path | None,
    tls: TLSClientFiles | None = None,
) -> Any:
    """Push a checkpoint; ``tls``: to replicas serving the push over (mutual) TLS."""
    if not checkpoint.is_dir():
        raise ConfigError(f"checkpoint: {checkpoint} is not a directory")
    bad = [t for t in targets if not _TARGET.match(t)]
    if bad:
        raise ConfigError(f"target: {bad} must look like host:port")
    token = read_secret(str(token_file) if token_file is not None else None, token_env, "token_file")
    if not token:
        raise ConfigError(f"token: set the env var {token_env!r} or pass --token-file")
    # lazy: grpc and the weight client (torch) only for push-weights
    import grpc

    from services.transport.weights.client import WeightPushError, push_checkpoint
    from services.transport.weights.tls import ChannelSecurity

    try:
        report = push_checkpoint(str(checkpoint), list(targets), token, version,
                                 security=ChannelSecurity.from_files(tls))
    except WeightPushError as exc:
        print(json.dumps({"ok": False, "error": str(exc), "targets": exc.results}), flush=True)
        raise SystemExit(1) from None
    except grpc.RpcError as exc:  # e.g. asking an unreachable replica for its version
        detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        print(json.dumps({"ok": False, "error": detail}), flush=True)
        raise SystemExit(1) from None
    except FileNotFoundError as exc:
        raise ConfigError(f"checkpoint: {exc}") from None
    print(
        json.dumps(
            {
                "ok": True,
                "version": report.version,
                "tensors": report.tensors,
                "bytes": report.bytes,
                "seconds": round(report.seconds, 4),
                "targets": list(targets),
            }
        ),
        flush=True,
    )
    return report
