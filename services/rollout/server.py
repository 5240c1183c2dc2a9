"""FastAPI app of the rollout service: ``POST /v1/rollouts`` (JSON or SSE), ``/healthz``, ``/metrics``.

The app owns the agent loop (engine + tokenizer + sandbox/reward clients) and, when configured,
the Redis worker and the gRPC weight-push server, all started and stopped with its lifespan.
``app.state.drain()`` (awaited on SIGTERM, services/rollout/shutdown.py, before the server stops)
drains the replica: ``/healthz`` says ``draining`` (503), ``/v1/rollouts`` answers 503, the worker
takes no job and hands back what it holds (services/rollout/worker.py); it returns once it has.
Invariant: a malformed request is a 422 naming the field; the weight token is never logged.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.errors import error as api_error
from services.common.errors import field_error, responses
from services.common.http_auth import protect
from services.common.logging import get_logger
from services.common.metrics import add_observability_routes
from services.common.schemas import Group, version_range
from services.rollout.agent.drain import SampleDrained
from services.rollout.agent.loop import AgentLoop, RewardUnavailable, Scorer, Tokenizer
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.api import RolloutRequest, sse
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import Engine, GenerationChunk, SamplingParams, engine_error
from services.rollout.metrics import RolloutMetrics
from services.rollout.openai_api.router import openai_router
from services.transport.sandbox.client import SandboxClient, SandboxUnavailable

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


# /v1/rollouts: JSON (a Group) or, with stream, server-sent events; and every error it answers
ROLLOUT_RESPONSES = {
    200: {"model": Group, "description": "the scored group, or with stream=true server-sent events",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **responses(400, 401, 422, 429, 502, 503, descriptions={
        502: "the sandbox or reward service failed",
        503: "the engine is down (restart the service), or the replica drains (send it elsewhere)"}),
}


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
        from services.transport.reward.client import RewardClient

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
            from services.common.queue import RedisStream, connect
            from services.rollout.worker import RolloutWorker

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

    @app.post("/v1/rollouts", response_model=None, responses=ROLLOUT_RESPONSES)
    async def rollouts(req: RolloutRequest) -> JSONResponse | StreamingResponse:
        if (error := engine_error(engine)) is not None:  # e.g. vLLM's engine core died: restart me
            metrics.requests.labels("rejected").inc()
            return api_error(503, f"engine unavailable: {error}")
        if state["draining"]:
            metrics.requests.labels("rejected").inc()
            return api_error(503, "this replica is draining (shutting down): send the request to another one")
        if req.n > cfg.max_n:
            return field_error(["body", "n"], f"n={req.n} exceeds the limit max_n={cfg.max_n}")
        if req.ground_truth is not None and scorer is None:
            return field_error(["body", "ground_truth"], "this server has no reward service (reward_url)")
        if state["in_flight"] >= cfg.max_concurrent_requests:
            metrics.requests.labels("rejected").inc()
            return api_error(429, "too many rollout requests in flight "
                             f"(max_concurrent_requests={cfg.max_concurrent_requests})")
        if req.prompt_ids is not None:
            prompt_ids = list(req.prompt_ids)
        else:
            assert req.messages is not None
            try:
                prompt_ids = agent.build_prompt([m.model_dump(exclude_none=True) for m in req.messages])
            except Exception as exc:  # a chat template may reject a message sequence
                return field_error(["body", "messages"], f"chat template failed: {exc}")
        if len(prompt_ids) > cfg.max_prompt_tokens:
            where = ["body", "prompt_ids" if req.prompt_ids is not None else "messages"]
            return field_error(
                where,
                f"prompt has {len(prompt_ids)} tokens, above the limit "
                f"max_prompt_tokens={cfg.max_prompt_tokens}",
            )
        job_id = req.request_id or uuid.uuid4().hex
        kwargs = {
            "sampling": req.sampling,
            "max_turns": req.max_turns,
            "ground_truth": req.ground_truth,
            "data_source": req.data_source,
            "request_id": job_id,
        }

        def group_of(trajs: list[Any]) -> Group:
            lo, hi = version_range(trajs)
            return Group(
                job_id=job_id,
                prompt_ids=prompt_ids,
                trajectories=trajs,
                ground_truth=req.ground_truth,
                data_source=req.data_source,
                min_version=lo,
                max_version=hi,
                replica="http",
            )

        if not req.stream:
            state["in_flight"] += 1
            metrics.in_flight.inc()
            try:
                trajs = await agent.run_group(prompt_ids, req.n, **kwargs)
            except RewardUnavailable as exc:
                metrics.requests.labels("reward_error").inc()
                return api_error(502, str(exc))
            except SandboxUnavailable as exc:
                metrics.requests.labels("sandbox_error").inc()
                return api_error(502, str(exc))
            except SampleDrained:
                metrics.requests.labels("rejected").inc()
                return api_error(503, "this replica drained (shut down) mid-rollout: send the request again")
            finally:
                state["in_flight"] -= 1
                metrics.in_flight.dec()
            metrics.requests.labels("ok").inc()
            return JSONResponse(group_of(trajs).model_dump(mode="json"))
        return StreamingResponse(
            _stream(agent, prompt_ids, req.n, kwargs, job_id, timed, state, metrics),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    return app


async def _stream(
    agent: AgentLoop,
    prompt_ids: list[int],
    n: int,
    kwargs: dict[str, Any],
    job_id: str,
    engine: Engine,
    state: dict[str, Any],
    metrics: RolloutMetrics,
) -> AsyncIterator[bytes]:
    events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def sink(ev: dict[str, Any]) -> None:
        await events.put(ev)

    async def produce() -> None:
        try:
            await agent.run_group(prompt_ids, n, on_event=sink, **kwargs)
            await events.put({"type": "end", "job_id": job_id, "n": n, "weight_version": engine.version})
        except Exception as exc:
            log.error("streamed rollout failed", exc_info=True)
            await events.put({"type": "error", "detail": str(exc)})
        finally:
            await events.put(None)

    state["in_flight"] += 1
    metrics.in_flight.inc()
    task = asyncio.create_task(produce())
    ok = False
    try:
        while (ev := await events.get()) is not None:
            kind = ev.pop("type")
            ok = ok or kind == "end"
            yield sse(kind, ev)
    finally:
        # When the client goes away, Starlette cancels this generator, and its cancellation is
        # level-triggered (anyio): every ``await`` in here is cancelled again. So stop generating and
        # do the bookkeeping before the one await, which only reaps the (cancelled) producer.
        task.cancel()
        state["in_flight"] -= 1
        metrics.in_flight.dec()
        metrics.requests.labels("ok" if ok else "error").inc()
        await asyncio.gather(task, return_exceptions=True)


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
    import inspect

    try:
        return len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        return False
