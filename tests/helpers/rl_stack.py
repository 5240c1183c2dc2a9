"""The services of an end-to-end RL run, started for a test: Redis and one rollout replica (HF
engine unless ``extra_args`` say otherwise) consuming prompt jobs from Redis, wired to the test's
sandbox and reward services, its weights pushable over gRPC with ``token``.

``rl_stack`` yields what ``tests/e2e/test_rl_pipeline.py``'s ``_config`` reads: ``tmp``, ``redis``,
``model`` (the trainer's starting model), ``grpc`` (the replica's weight endpoint) and ``http``.
Invariant: on exit the replica is stopped before Redis.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from services.common.process import ServiceProcess, free_port
from tests.helpers.redis_server import RedisServer


@contextmanager
def rl_stack(tmp: Path, model: Path, sandbox_url: str, reward_url: str, token: str, *,
             served: Path | None = None, extra_args: Sequence[str] = (), startup_timeout_s: float = 180
             ) -> Iterator[dict[str, Any]]:
    """Redis + ``rollout serve`` of ``served`` (default: ``model``), as a dict for the run config."""
    redis = RedisServer(tmp / "redis").start()
    try:
        grpc_port = free_port()
        args = ["rollout", "serve", "--model", str(served or model), "--grpc-port", str(grpc_port),
                "--sandbox-url", sandbox_url, "--reward-url", reward_url, "--redis-url", redis.url,
                "--weight-token-env", "RETOOL_WEIGHT_TOKEN", "--set", "redis.block_ms=100", *extra_args]
        rollout = ServiceProcess(args, env={"RETOOL_WEIGHT_TOKEN": token}, log_path=tmp / "rollout.log",
                                 startup_timeout_s=startup_timeout_s)
        with rollout:
            yield {"tmp": tmp, "redis": redis, "model": model, "served": served or model,
                   "grpc": f"127.0.0.1:{grpc_port}", "http": rollout.url}
    finally:
        redis.stop()
