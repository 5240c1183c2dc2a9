"""FastAPI app of the sandbox service: ``POST /run_code``, sessions (``session_api``), health, metrics.

Invariant: ``/healthz`` says ``"isolation": "ok"`` only when every layer holds; under
``isolation: degraded`` with a layer missing it says ``"degraded"`` with the gaps, and every
response carries ``X-Sandbox-Isolation`` (run answers also say it in ``message``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.errors import error, responses
from services.common.http_auth import protect
from services.common.metrics import MetricsRegistry, add_observability_routes
from services.sandbox.config import SandboxConfig
from services.sandbox.executor import Executor, QueueFull, QueueTimeout
from services.sandbox.phases import PHASES
from services.sandbox.session_api import SessionAPI
from services.sandbox.sessions import SessionRegistry
from services.transport.sandbox.schemas import RunCodeRequest, RunCodeResponse, RunStatus, SandboxHealth


class SandboxMetrics:
    def __init__(self) -> None:
        self.registry = MetricsRegistry("sandbox")
        self.requests = self.registry.counter("requests_total", "Run requests by outcome status",
                                              ("status",))
        self.latency = self.registry.histogram("execution_seconds", "Run latency incl. queueing")
        self.in_flight = self.registry.gauge("executions_in_flight", "Runs executing now")
        self.queue_depth = self.registry.gauge("queue_depth", "Requests waiting for a slot")
        self.rejections = self.registry.counter("rejections_total", "Requests answered 504 (busy)",
                                                ("reason",))
        self.truncations = self.registry.counter("output_truncations_total", "Runs with capped output")
        for status in RunStatus:  # export every known label value from the start (0, not absent)
            self.requests.labels(status.value)
        for reason in ("queue_full", "queue_timeout"):
            self.rejections.labels(reason)
        self.phase_cpu = self.registry.counter(
            "run_phase_cpu_seconds", "CPU seconds spent per step of stateless runs (fork, init, run_start, "
            "namespaces, cgroup, mounts, filter, code, exit)", ("phase",))
        self.phase_runs = self.registry.counter("run_phase_runs", "Stateless runs measured in "
                                                "sandbox_run_phase_cpu_seconds_total")
        for phase in PHASES:
            self.phase_cpu.labels(phase)

    def count_phases(self, phases: dict[str, float]) -> None:
        self.phase_runs.inc()
        for name, seconds in phases.items():
            self.phase_cpu.labels(name).inc(seconds)


class IsolationHeader:
    """ASGI middleware: under degraded isolation every HTTP response carries ``X-Sandbox-Isolation``.

    Plain ASGI (no per-request task, unlike ``BaseHTTPMiddleware``): with full isolation it
    costs one attribute check per response."""

    def __init__(self, app: ASGIApp, executor: Executor) -> None:
        self.app = app
        self.executor = executor

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_noted(message: Message) -> None:
            if message["type"] == "http.response.start" and self.executor.degraded:
                note = self.executor.isolation_note()[0].encode("ascii", "backslashreplace")
                message["headers"] = [*message.get("headers", []), (b"x-sandbox-isolation", note)]
            await send(message)

        await self.app(scope, receive, send_noted)


def create_app(cfg: SandboxConfig) -> FastAPI:
    executor = Executor(cfg)
    metrics = SandboxMetrics()
    registry = SessionRegistry(cfg, executor.session_zygotes(), executor.session_cgroup)
    sessions = SessionAPI(cfg, registry, metrics.registry, executor.isolation_note)
    metrics.in_flight.set_function(lambda: executor.stats.in_flight)
    metrics.queue_depth.set_function(lambda: executor.stats.queued)
    executor.on_phases = metrics.count_phases

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await executor.start()
        await registry.start()
        try:
            yield
        finally:
            await registry.stop()
            await executor.stop()

    app = FastAPI(title="retool sandbox", version="0.1.0", lifespan=lifespan)
    protect(app, cfg.security, metrics.registry)
    app.state.executor = executor

    app.add_middleware(IsolationHeader, executor=executor)

    def health() -> dict[str, object]:
        alive = executor.healthy_zygotes
        return SandboxHealth(
            status="ok" if alive > 0 else "degraded", zygotes_alive=alive, zygotes=len(executor.zygotes),
            zygote_restarts=sum(z.restarts for z in executor.zygotes), in_flight=executor.stats.in_flight,
            queued=executor.stats.queued, max_concurrency=cfg.max_concurrency,
            cgroups=executor.cgroups.version if executor.cgroups else None,
            isolation="degraded" if executor.degraded else "ok", isolation_gaps=list(executor.gaps),
            warnings=[f"isolation degraded: {gap}" for gap in executor.gaps],
            sessions=len(registry.live), max_sessions=cfg.max_sessions, runtime=executor.runtime_info(),
        ).model_dump()

    add_observability_routes(app, metrics.registry, health)

    @app.post("/run_code", response_model=RunCodeResponse, responses=responses(
        400, 401, 404, 410, 504, descriptions={404: "unknown session_id", 410: "that session ended"}))
    async def run_code(req: RunCodeRequest, response: Response) -> RunCodeResponse | JSONResponse:
        if req.session_id is not None:
            return await sessions.run_code(req)
        start = time.perf_counter()
        try:
            resp = await executor.run(req)
        except (QueueFull, QueueTimeout) as exc:
            # 504 is the one status verl's client retries (SandboxFusion's client retries any)
            reason = "queue_full" if isinstance(exc, QueueFull) else "queue_timeout"
            metrics.rejections.labels(reason).inc()
            return error(504, str(exc), retry_after=1)
        metrics.latency.observe(time.perf_counter() - start)
        metrics.requests.labels(resp.status.value).inc()
        if resp.run_result and "[output truncated:" in ((resp.run_result.stdout or "")
                                                         + (resp.run_result.stderr or "")):
            metrics.truncations.inc()
        if resp.message and resp.status != RunStatus.SandboxError:
            response.headers["X-Sandbox-Notes"] = resp.message.encode("ascii", "backslashreplace").decode()
        return resp

    sessions.mount(app)
    return app
