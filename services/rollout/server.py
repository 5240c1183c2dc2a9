"""FastAPI app of the rollout service: ``/healthz``, ``/metrics``, and the routers of ``POST /v1/rollouts``
(routes/rollouts.py) and the OpenAI API (openai_api/router.py).

The app owns the agent loop (engine + tokenizer + sandbox/reward clients) and, when configured,
the Redis worker and the gRPC weight-push server, all started and stopped with its lifespan.
``app.state.drain()`` (awaited on SIGTERM, services/rollout/shutdown.py, before the server stops)
drains the replica: ``/healthz`` says ``draining`` (503), ``/v1/rollouts`` answers 503, the worker
takes no job and hands back what it holds (services/rollout/worker.py); it returns once it has.
Invariant: a malformed request is a 422 naming the field; the weight token is never logged.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import torch
from fastapi import FastAPI

from services.common.http_auth import protect
from services.common.logging import get_logger
from services.common.metrics import add_observability_routes
from services.common.queue import RedisStream, connect
from services.rollout.agent.loop import AgentLoop, Scorer, Tokenizer
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import Engine, GenerationChunk, SamplingParams, engine_error
from services.rollout.metrics import RolloutMetrics
from services.rollout.openai_api.router import openai_router
from services.rollout.routes.rollouts import rollouts_router
from services.rollout.worker import RolloutWorker
from services.transport.reward.client import RewardClient
from services.transport.sandbox.client import SandboxClient

log = get_logger("rollout")
T = TypeVar("T")

# ``start_weight_server(engine, host, port, token, registry=...)`` (services.rollout.weights.server):
# returns a started server with an async ``stop(grace)``
WeightServerFactory = Callable[..., Awaitable[Any]]


class TimedEngine:
    """Delegates to an engine; times ``load_weights`` into the weight-load metric."""

    def __init__(self, inner: Engine, metrics: RolloutMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        return self.inner.generate(prompt_ids, params, request_id)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self._timed(self.inner.load_weights(named_tensors, version), version)

    async def _timed_adopt(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> dict[str, torch.Tensor]:
        return await self._timed(self.inner.adopt_weights(named_tensors, version), version)  # type: ignore[attr-defined]

    async def _timed_patch(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], patches: Iterable[Any], version: int
    ) -> dict[str, torch.Tensor]:
        return await self._timed(self.inner.patch_weights(named_tensors, patches, version), version)  # type: ignore[attr-defined]

    async def _timed(self, load: Awaitable[T], version: int) -> T:
        start = time.perf_counter()
        result = await load
        seconds = time.perf_counter() - start
        self.metrics.weight_load.observe(seconds)
        log.info("weights loaded", extra={"version": version, "seconds": round(seconds, 3)})
        return result

    async def shutdown(self) -> None:
        await self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # engine-specific extras (e.g. tokenizer, model)
        value = getattr(self.inner, name)
        if name == "adopt_weights":  # zero-copy load (HFEngine), timed like load_weights
            return self._timed_adopt
        if name == "patch_weights":  # delta push applied in place (HFEngine), timed like load_weights
            return self._timed_patch
        return value


def create_app(
    cfg: RolloutConfig,
    engine: Engine,
    tokenizer: Tokenizer,
    *,
    scorer: Scorer | None = None,
    weight_token: str | None = None,
    weight_server_factory: WeightServerFactory | None = None,
) -> FastAPI:
    metrics = RolloutMetrics()
    timed = TimedEngine(engine, metrics)
    metrics.weight_version.set_function(lambda: float(timed.version))
    sandbox = SandboxTool(SandboxClient(
        cfg.sandbox_url,
        run_timeout_s=cfg.agent.sandbox_run_timeout_s,
        memory_mb=cfg.agent.sandbox_memory_mb,
        request_timeout_s=cfg.agent.sandbox_request_timeout_s,
        retries=cfg.agent.sandbox_retries,
        backoff_s=cfg.agent.sandbox_retry_backoff_s,
        retries_counter=metrics.retries,
        client_kwargs=cfg.sandbox_security.httpx_kwargs("sandbox_security"),
        allow_degraded=cfg.agent.allow_degraded_sandbox,
        on_degraded=metrics.sandbox_degraded_answer,
    ))
    reward_client = None
    if scorer is None and cfg.reward_url:
        reward_client = RewardClient(cfg.reward_url, timeout_s=cfg.agent.reward_timeout_s,
                                     retries_counter=metrics.retries,
                                     client_kwargs=cfg.reward_security.httpx_kwargs("reward_security"))
        scorer = reward_client
    agent = AgentLoop(timed, tokenizer, sandbox, cfg.agent, scorer=scorer, observer=metrics)
    state: dict[str, Any] = {"in_flight": 0, "worker": None, "worker_task": None, "draining": False}

    async def drain() -> None:
        """Stop taking work and hand back the Redis jobs held; returns once they are handed back."""
        if state["draining"]:
            return
        state["draining"] = True
        metrics.draining.set(1)
        agent.draining.set()
        log.info("draining: no new jobs; running ones get drain_s, then are handed back",
                 extra={"drain_s": cfg.redis.drain_s, "running": state["in_flight"]})
        if state["worker"] is not None:
            state["worker"].begin_drain()
            await asyncio.gather(state["worker_task"], return_exceptions=True)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await sandbox.check_isolation()  # a degraded sandbox: refused here, or logged loudly
        stop = asyncio.Event()
        worker_task = redis_client = weight_server = None
        if cfg.redis.url:
            redis_client = connect(cfg.redis.url, cfg.redis.auth)
            worker = RolloutWorker(
                agent,
                RedisStream(redis_client, cfg.redis.prompts_stream, cfg.redis.group),
                RedisStream(redis_client, cfg.redis.groups_stream),
                cfg.redis,
                max_n=cfg.max_n,
                max_prompt_tokens=cfg.max_prompt_tokens,
            )
            _worker_metrics(metrics, worker)
            state["worker"] = worker
            worker_task = state["worker_task"] = asyncio.create_task(worker.run(stop))
        if cfg.grpc_port is not None and weight_server_factory is not None:
            if not weight_token:
                raise RuntimeError(
                    "grpc_port is set but no weight-push token was found (weight_token_env / "
                    "weight_token_file)"
                )
            tls = {"tls": cfg.weight_tls} if cfg.weight_tls is not None else {}
            weight_server = await weight_server_factory(
                timed, cfg.host, cfg.grpc_port, weight_token, registry=metrics.registry, **tls
            )
            log.info(
                "weight-push gRPC server listening", extra={"port": getattr(weight_server, "port", None)}
            )
        try:
            yield
        finally:
            stop.set()
            if worker_task is not None:
                await asyncio.gather(worker_task, return_exceptions=True)
            if weight_server is not None:
                await _close(weight_server)
            if redis_client is not None:
                await redis_client.aclose()
            await sandbox.aclose()
            if reward_client is not None:
                await reward_client.aclose()
            await timed.shutdown()

    app = FastAPI(title="retool rollout", version="0.1.0", lifespan=lifespan)
    app.state.drain = drain
    protect(app, cfg.security, metrics.registry)

    def health() -> dict[str, Any]:
        error = engine_error(engine)
        return {
            "status": "error" if error is not None else "draining" if state["draining"] else "ok",
            "engine_error": error,
            "model": cfg.model,
            "engine": cfg.engine,
            "weight_version": timed.version,
            "tool_format": cfg.agent.tool_format,
            "in_flight": state["in_flight"],
            "redis_worker": state["worker"] is not None,
            "draining": state["draining"],
            "scored": scorer is not None,
        }

    add_observability_routes(app, metrics.registry, health)

    app.include_router(openai_router(cfg, timed, tokenizer, metrics, state))
    app.include_router(rollouts_router(cfg, engine, agent, scorer, state, metrics))

    return app


def _worker_metrics(metrics: RolloutMetrics, worker: Any) -> None:
    stats = worker.stats
    metrics.worker_in_flight.set_function(lambda: float(stats.in_flight))
    for outcome, attr in (
        ("done", "jobs_done"),
        ("failed", "jobs_failed"),
        ("dead", "jobs_dead"),
        ("reclaimed", "jobs_reclaimed"),
        ("handed_back", "jobs_handed_back"),
        ("taken_over", "jobs_taken_over"),
    ):
        metrics.worker_jobs.labels(outcome).set_function(lambda a=attr: float(getattr(stats, a)))
    worker.on_handed_back = metrics.jobs_handed_back.inc
    worker.on_taken_over = metrics.handback_pickup.observe


async def _close(server: Any) -> None:
    stop = getattr(server, "stop", None)
    if stop is None:
        return
    res = stop(5) if _accepts_grace(stop) else stop()
    if asyncio.iscoroutine(res) or isinstance(res, asyncio.Future):
        await res


def _accepts_grace(fn: Callable[..., Any]) -> bool:
    try:
        return len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        return False
