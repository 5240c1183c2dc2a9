"""FastAPI app of the reward service: ``/score``, ``/score/batch``, ``/healthz``, ``/metrics``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import get_args

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.common.metrics import MetricsRegistry, add_observability_routes
from services.reward.config import RewardConfig
from services.reward.grader import Grader, Reason
from services.reward.schemas import BatchRequest, BatchResponse, ScoreRequest, ScoreResult
from services.reward.scoring import score


class RewardMetrics:
    def __init__(self) -> None:
        self.registry = MetricsRegistry("reward")
        self.grades = self.registry.counter("grades_total", "Grades by outcome reason", ("reason",))
        self.latency = self.registry.histogram("grade_seconds", "Latency of one grade")
        self.timeouts = self.registry.counter("timeouts_total", "Symbolic checks killed at the limit")
        for reason in get_args(Reason):  # export every outcome from the start (0, not absent)
            self.grades.labels(reason)
        self.batch_size = self.registry.histogram(
            "batch_size", "Items per batch request", buckets=(1, 8, 32, 64, 128, 256, 512, 1024, 4096)
        )


def _error_422(loc: list[str | int], msg: str) -> JSONResponse:
    """The same shape as FastAPI's own validation errors: the field is in ``detail[].loc``."""
    detail = [{"type": "value_error", "loc": loc, "msg": msg}]
    return JSONResponse(status_code=422, content={"detail": detail})


def create_app(cfg: RewardConfig) -> FastAPI:
    grader = Grader(cfg.workers, cfg.timeout_s, cfg.max_answer_chars)
    metrics = RewardMetrics()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await grader.start()
        try:
            yield
        finally:
            await grader.stop()

    app = FastAPI(title="retool reward", version="0.1.0", lifespan=lifespan)
    add_observability_routes(
        app,
        metrics.registry,
        lambda: {
            "status": "ok" if grader.pool.alive > 0 else "degraded",
            "workers_alive": grader.pool.alive,
            "workers": cfg.workers,
            "timeout_s": cfg.timeout_s,
        },
    )

    async def one(req: ScoreRequest) -> ScoreResult:
        start = time.perf_counter()
        verdict = await grader.grade(req.response, req.ground_truth)
        value, shaping = score(verdict, req.num_tool_calls, cfg)
        metrics.latency.observe(time.perf_counter() - start)
        metrics.grades.labels(verdict.reason).inc()
        if verdict.reason == "timeout":
            metrics.timeouts.inc()
        return ScoreResult(
            score=value,
            correct=verdict.correct,
            extracted=verdict.extracted,
            reason=verdict.reason,
            shaping=shaping,
        )

    def too_long(items: list[ScoreRequest], batched: bool) -> JSONResponse | None:
        """422 naming the first field over its size limit (checked before any grading)."""
        limits = (("response", cfg.max_response_chars), ("ground_truth", cfg.max_ground_truth_chars))
        for i, item in enumerate(items):
            for field, limit in limits:
                if len(getattr(item, field)) > limit:
                    loc = ["body", "items", i, field] if batched else ["body", field]
                    return _error_422(loc, f"{field} longer than max_{field}_chars={limit}")
        return None

    @app.post("/score", response_model=ScoreResult)
    async def score_one(req: ScoreRequest) -> ScoreResult | JSONResponse:
        return too_long([req], batched=False) or await one(req)

    @app.post("/score/batch", response_model=BatchResponse)
    async def score_batch(req: BatchRequest) -> BatchResponse | JSONResponse:
        if len(req.items) > cfg.max_batch:
            return _error_422(["body", "items"], f"{len(req.items)} items exceed max_batch={cfg.max_batch}")
        if (err := too_long(req.items, batched=True)) is not None:
            return err
        metrics.batch_size.observe(len(req.items))
        return BatchResponse(results=list(await asyncio.gather(*(one(item) for item in req.items))))

    return app
