"""The trainer's Prometheus endpoint (rank 0): ``GET /metrics`` and ``GET /healthz``.

Invariants:
- the fixed series that alerts and dashboards rely on exist from the moment the server starts
  (step, last-step timestamp, policy version, staleness limit, weight-push failures, dropped
  groups by reason, queue depth/lag), so a rule never silently evaluates an absent series;
- per-step metrics (``actor/pg_loss`` ...) become gauges ``trainer_<key with / . - → _>``; the
  rollout–trainer mismatch gauges (``MISMATCH_KEYS``, used by an alert) exist from start-up as
  NaN (no comparison is true: nothing fires before a step has measured it);
- ``/healthz`` is 200 while the process serves; it reports the step and the seconds since
  the last step (a stalled trainer is an alert, not a restart: a long validation is normal).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from services.common.metrics import MetricsRegistry

DROP_REASONS = ("stale", "duplicate", "filtered", "malformed", "dead_lettered")
MISMATCH_KEYS = ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/k3_kl", "mismatch/tis_capped_frac",
                 "mismatch/mis_masked_frac")
QUEUE_KEYS = {
    "queue/prompts_depth": ("prompts", "depth"),
    "queue/groups_depth": ("groups", "depth"),
    "queue/groups_lag": ("groups", "lag"),
    "queue/groups_pending": ("groups", "pending"),
}


def gauge_name(key: str) -> str:
    return key.replace("/", "_").replace("@", "_at_").replace("-", "_").replace(".", "_")


class TrainerExporter:
    """Metrics of one trainer process, served over HTTP when ``port`` is given."""

    def __init__(self, registry: MetricsRegistry, port: int | None = None, host: str = "127.0.0.1") -> None:
        r = self.registry = registry
        self.step = r.gauge("step", "Training steps completed")
        self.last_step = r.gauge("last_step_timestamp_seconds", "Unix time the last training step finished")
        self.version = r.gauge("policy_version", "Policy version after the last step")
        self.staleness_limit = r.gauge("max_staleness", "Configured max_staleness (policy versions)")
        self.push_failures = r.counter(
            "weight_push_failures_total", "Weight push attempts that failed (any replica)"
        )
        self.push_targets = r.gauge("weight_push_targets", "Rollout replicas the last push went to")
        self.retries = r.counter(
            "retries_total", "Retried calls to another service (services/common/retry.py)",
            ("target", "reason"))
        self.retries.labels("weights", "push_failed")  # the series exists (at 0) before the first retry
        self.dropped = r.counter(
            "dropped_groups_total", "Groups dropped before training, by reason", ("reason",)
        )
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        self.reissued = r.counter(
            "jobs_reissued_total", "Prompt jobs found in no Redis stream (lost with Redis) and pushed again")
        self.redis_errors = r.counter(
            "redis_connection_errors_total", "Redis commands that failed on the connection and were retried")

        # lazy: the GPU check imports this module (via trainer/push.py) on machines without redis,
        # whose optional imports (opentelemetry, cryptography) they lack too (test_gpu_wheels.py)
        from services.common.queue import CONNECTION_ERROR_HOOKS

        CONNECTION_ERROR_HOOKS.append(self.redis_errors.inc)
        self.resumed_from = r.gauge("resumed_from_step",
                                    "Checkpoint step this process resumed from (0: none)")
        self.queue = r.gauge("queue_messages", "Redis stream entries, by stream and kind", ("stream", "kind"))
        for stream, kind in QUEUE_KEYS.values():
            self.queue.labels(stream, kind)
        self.last_step.set(time.time())  # "stalled" counts from start-up until the first step
        self._gauges: dict[str, Any] = {}
        for key in MISMATCH_KEYS:
            self._gauge(key).set(float("nan"))
        self._started = time.time()
        self._server: WSGIServer | None = None
        if port is not None:
            self._server = _serve(self, host, port)
        global _CURRENT
        _CURRENT = self

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server else None

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """One finished step's metrics (called by the metrics sink on rank 0)."""
        for key, value in metrics.items():
            if key.startswith("rollout/dropped_"):
                self.dropped.labels(key.removeprefix("rollout/dropped_")).inc(value)
            elif key in QUEUE_KEYS:
                self.queue.labels(*QUEUE_KEYS[key]).set(value)
            elif key == "policy/version":
                self.version.set(value)
                continue
            elif key == "weights/push_targets":
                self.push_targets.set(value)
            self._gauge(key).set(value)
        self.step.set(step)
        self.last_step.set(time.time())

    def _gauge(self, key: str) -> Any:
        name = gauge_name(key)
        if name not in self._gauges:
            self._gauges[name] = self.registry.gauge(name, key)
        return self._gauges[name]

    def health(self) -> dict[str, object]:
        return {
            "status": "ok",
            "step": int(self.step._value.get()),
            "seconds_since_last_step": round(time.time() - self.last_step._value.get(), 3),
            "uptime_s": round(time.time() - self._started, 3),
        }

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


_CURRENT: TrainerExporter | None = None


def note_push_failure() -> None:
    """Count a failed weight push on this process's exporter (no-op where none runs: ranks > 0)."""
    if _CURRENT is not None:
        _CURRENT.push_failures.inc()


def note_reissued(n: int) -> None:
    """Count re-issued prompt jobs on this process's exporter (no-op where none runs)."""
    if _CURRENT is not None:
        _CURRENT.reissued.inc(n)


def note_resumed(step: int) -> None:
    if _CURRENT is not None:
        _CURRENT.resumed_from.set(step)


def retries_counter() -> Any:
    """This process's retry counter (labels ``target, reason``); None where no exporter runs."""
    return _CURRENT.retries if _CURRENT is not None else None


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: no access log
        pass


def _serve(exporter: TrainerExporter, host: str, port: int) -> WSGIServer:
    """prometheus-client's own exposition (``make_wsgi_app``: gzip, OpenMetrics negotiation,
    ``name[]`` filters) on its threading WSGI server, with ``/healthz`` routed in front of it."""
    metrics_app = make_wsgi_app(exporter.registry.registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            status, ctype, body = "200 OK", "application/json", json.dumps(exporter.health()).encode()
        else:
            status, ctype, body = "404 Not Found", "text/plain", b"not found: use /metrics or /healthz\n"
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="trainer-metrics", daemon=True).start()
    return server


async def queue_stats(prompts: Any, groups: Any) -> dict[str, float]:
    """Depth of both streams and the trainer group's lag/pending on ``groups`` (RedisStream)."""
    return {
        "queue/prompts_depth": float(await prompts.depth()),
        "queue/groups_depth": float(await groups.depth()),
        "queue/groups_lag": float(await groups.lag()),
        "queue/groups_pending": float(await groups.pending()),
    }
