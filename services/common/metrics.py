"""Prometheus helpers: a per-app registry and the standard ``/metrics`` + ``/healthz`` routes.

Invariant: every app owns its own ``CollectorRegistry`` so several apps (tests, embedded
demo) can live in one process without duplicate-metric errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class MetricsRegistry:
    """Factory for metrics bound to one registry, with a common name prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry()
        # a restart shows as a change of this value (``changes(<prefix>_start_time_seconds[5m])``),
        # even when it is quicker than a scrape interval and ``up`` never reads 0
        self.gauge("start_time_seconds", "Unix time this service's metrics were created").set(time.time())

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(f"{self.prefix}_{name}", doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(f"{self.prefix}_{name}", doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = (),
                  buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(f"{self.prefix}_{name}", doc, labels, buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def add_observability_routes(app: FastAPI, metrics: MetricsRegistry,
                             health: Callable[[], dict[str, object]]) -> None:
    """Mount ``GET /metrics`` (Prometheus text) and ``GET /healthz`` (JSON; 503 when not ok)."""

    @app.get("/metrics", include_in_schema=False)
    def _metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", responses={503: {
        "description": "not ok (status is not \"ok\"): the same body, saying what is wrong",
        "content": {"application/json": {"schema": {"type": "object", "additionalProperties": True}}}}})
    def _healthz(response: Response) -> dict[str, object]:
        state = health()
        if state.get("status") != "ok":
            response.status_code = 503
        return state
