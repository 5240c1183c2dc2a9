"""FastAPI app of the reward service: ``/score``, ``/score/batch``, ``/healthz``, ``/metrics``.

Overload is explicit: a request whose symbolic checks do not fit in ``max_queue`` gets 503
with ``Retry-After`` and nothing of it is graded (``RewardClient`` waits and retries); an
admitted request is always graded in full, however long it waits for a worker.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import get_args

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.errors import error, field_error, responses
from services.common.http_auth import protect
from services.common.metrics import MetricsRegistry, add_observability_routes
from services.reward.config import RewardConfig
from services.reward.grader import Grader, Overloaded, Reason
from services.reward.scoring import score
from services.reward.workers import SymbolicPool
from services.transport.reward.schemas import BatchRequest, BatchResponse, ScoreRequest, ScoreResult


class _PoolCollector(Collector):
    """The symbolic pool's own counters, read at scrape time (no double bookkeeping)."""

    def __init__(self, pool: SymbolicPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        st = self.pool.stats
        counters = (
            ("checks", "Symbolic checks that reached a worker", st.checks),
            ("timeouts", "Symbolic checks stopped at the work limit or the wall backstop", st.timeouts),
            ("wall_timeouts", "Of those, stopped at the wall backstop (a starved worker)", st.wall_timeouts),
            ("work_seconds", "Wall seconds workers spent on checks", st.work_seconds),
            ("cpu_seconds", "CPU seconds workers spent on checks (what timeout_s limits)", st.cpu_seconds),
            ("wait_seconds", "Seconds checks waited for a free worker (never counted in the limit)",
             st.wait_seconds),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"reward_symbolic_{name}", doc, value=value)
        admitted = self.pool.admitted
        yield GaugeMetricFamily("reward_symbolic_admitted", "Checks admitted and unfinished", admitted)
        yield GaugeMetricFamily("reward_symbolic_idle_workers", "Workers free right now", self.pool.idle)


class RewardMetrics:
    def __init__(self, pool: SymbolicPool) -> None:
        self.registry = MetricsRegistry("reward")
        self.grades = self.registry.counter("grades_total", "Grades by outcome reason", ("reason",))
        self.latency = self.registry.histogram(
            "grade_seconds", "Latency of one grade, from request to verdict (a batch's items: the batch's)"
        )
        self.timeouts = self.registry.counter(
            "timeouts_total", "Grades ended as timeout (work limit hit, or answer too long to parse)"
        )
        self.overloaded = self.registry.counter(
            "overloaded_total", "Requests refused with 503 because max_queue checks were admitted"
        )
        for reason in get_args(Reason):  # export every outcome from the start (0, not absent)
            self.grades.labels(reason)
        self.batch_size = self.registry.histogram(
            "batch_size", "Items per batch request", buckets=(1, 8, 32, 64, 128, 256, 512, 1024, 4096)
        )
        self.registry.registry.register(_PoolCollector(pool))


# every status /score and /score/batch answer besides 200, declared in /openapi.json
SCORE_ERRORS = responses(400, 401, 422, 503)


def create_app(cfg: RewardConfig) -> FastAPI:
    grader = Grader(cfg.workers, cfg.timeout_s, cfg.max_answer_chars, cfg.max_queue)
    metrics = RewardMetrics(grader.pool)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await grader.start()
        try:
            yield
        finally:
            await grader.stop()

    app = FastAPI(title="retool reward", version="0.1.0", lifespan=lifespan)
    protect(app, cfg.security, metrics.registry)
    add_observability_routes(
        app,
        metrics.registry,
        lambda: {
            "status": "ok" if grader.pool.alive > 0 else "degraded",
            "workers_alive": grader.pool.alive,
            "workers": cfg.workers,
            "timeout_s": cfg.timeout_s,
            "admitted": grader.pool.admitted,
            "max_queue": cfg.max_queue,
        },
    )

    async def grade(items: list[ScoreRequest]) -> list[ScoreResult] | JSONResponse:
        """All items graded, or a 503 (nothing graded) when the symbolic queue is full."""
        start = time.perf_counter()
        try:
            verdicts = await grader.grade_many([(it.response, it.ground_truth) for it in items])
        except Overloaded as exc:
            metrics.overloaded.inc()
            return error(503, str(exc), retry_after=exc.retry_after_s)
        elapsed = time.perf_counter() - start
        out = []
        for req, verdict in zip(items, verdicts, strict=True):
            value, shaping = score(verdict, req.num_tool_calls, cfg)
            train = not (verdict.reason == "timeout" and cfg.timeout_policy == "drop")
            metrics.latency.observe(elapsed)
            metrics.grades.labels(verdict.reason).inc()
            if verdict.reason == "timeout":
                metrics.timeouts.inc()
            out.append(
                ScoreResult(
                    score=value if train else None,
                    correct=verdict.correct,
                    extracted=verdict.extracted,
                    reason=verdict.reason,
                    shaping=shaping if train else 0.0,
                    train=train,
                )
            )
        return out

    def too_long(items: list[ScoreRequest], batched: bool) -> JSONResponse | None:
        """422 naming the first field over its size limit (checked before any grading)."""
        limits = (("response", cfg.max_response_chars), ("ground_truth", cfg.max_ground_truth_chars))
        for i, item in enumerate(items):
            for field, limit in limits:
                if len(getattr(item, field)) > limit:
                    loc = ["body", "items", i, field] if batched else ["body", field]
                    return field_error(loc, f"{field} longer than max_{field}_chars={limit}")
        return None

    @app.post("/score", response_model=ScoreResult, responses=SCORE_ERRORS)
    async def score_one(req: ScoreRequest) -> ScoreResult | JSONResponse:
        if (err := too_long([req], batched=False)) is not None:
            return err
        got = await grade([req])
        return got if isinstance(got, JSONResponse) else got[0]

    @app.post("/score/batch", response_model=BatchResponse, responses=SCORE_ERRORS)
    async def score_batch(req: BatchRequest) -> BatchResponse | JSONResponse:
        if len(req.items) > cfg.max_batch:
            return field_error(["body", "items"], f"{len(req.items)} items exceed max_batch={cfg.max_batch}")
        if (err := too_long(req.items, batched=True)) is not None:
            return err
        metrics.batch_size.observe(len(req.items))
        got = await grade(req.items)
        return got if isinstance(got, JSONResponse) else BatchResponse(results=got)

    return app
