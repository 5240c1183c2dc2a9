"""The trainer's metrics endpoint (real HTTP server) and its weight-push failure accounting."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.common.metrics import MetricsRegistry
from services.common.process import free_port
from services.trainer.observability import TrainerExporter
from services.trainer.push import push_weights
from services.transport.weights.client import WeightPushError

pytestmark = pytest.mark.integration


@pytest.fixture
def exporter():
    exp = TrainerExporter(MetricsRegistry("trainer"), free_port(), host="127.0.0.1")
    yield exp
    exp.close()


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_the_metrics_server_binds_loopback_unless_the_run_config_says_otherwise(tmp_path):
    """Like every other service: 127.0.0.1 by default, ``metrics_host`` to open it (issue 33, 5b)."""
    from services.trainer.loop import MetricsSink
    from services.trainer.run_config import RunConfig

    assert RunConfig(dataset="rl.parquet").metrics_host == "127.0.0.1"
    sink = MetricsSink(str(tmp_path / "m.jsonl"), free_port())
    try:
        assert sink.exporter._server.server_address[0] == "127.0.0.1"
    finally:
        sink.exporter.close()
    opened = RunConfig(dataset="rl.parquet", metrics_host="0.0.0.0")
    sink = MetricsSink(str(tmp_path / "m.jsonl"), free_port(), host=opened.metrics_host)
    try:
        assert sink.exporter._server.server_address[0] == "0.0.0.0"
    finally:
        sink.exporter.close()


def test_fixed_series_exist_before_the_first_step_and_steps_update_them(exporter):
    base = f"http://127.0.0.1:{exporter.port}"
    text = httpx.get(f"{base}/metrics").text
    for name in (
        "trainer_last_step_timestamp_seconds",
        "trainer_weight_push_failures_total",
        'trainer_dropped_groups_total{reason="stale"}',
        'trainer_queue_messages{kind="lag",stream="groups"}',
    ):
        _sample(text, name)
    assert _sample(text, "trainer_step") == 0
    exporter.record(
        3,
        {
            "actor/pg_loss": 0.25,
            "policy/version": 3.0,
            "rollout/dropped_stale": 2.0,
            "queue/groups_lag": 7.0,
            "val-core/aime/acc/mean@4": 0.5,
        },
    )
    exporter.record(4, {"rollout/dropped_stale": 1.0})
    text = httpx.get(f"{base}/metrics").text
    assert _sample(text, "trainer_step") == 4
    assert _sample(text, "trainer_policy_version") == 3
    assert _sample(text, "trainer_actor_pg_loss") == 0.25
    assert _sample(text, 'trainer_dropped_groups_total{reason="stale"}') == 3
    assert _sample(text, 'trainer_queue_messages{kind="lag",stream="groups"}') == 7
    assert _sample(text, "trainer_val_core_aime_acc_mean_at_4") == 0.5
    health = httpx.get(f"{base}/healthz")
    assert health.status_code == 200 and health.json()["step"] == 4
    assert httpx.get(f"{base}/nope").status_code == 404
    # prometheus-client's exposition: gzip when asked, OpenMetrics when asked
    gz = httpx.get(f"{base}/metrics", headers={"Accept-Encoding": "gzip"})
    assert gz.headers["Content-Encoding"] == "gzip" and _sample(gz.text, "trainer_step") == 4
    om = httpx.get(f"{base}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["Content-Type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")


async def test_failed_push_attempts_are_counted_then_raised(exporter):
    dead = f"dns:localhost:{free_port()}"  # resolves; nothing listens there
    weights = {"lm.w": torch.zeros(4)}
    with pytest.raises(WeightPushError, match="UNAVAILABLE"):
        await push_weights(weights, [dead], 1, "tok", bucket_bytes=2**20, attempts=2, backoff_s=0)
    text = httpx.get(f"http://127.0.0.1:{exporter.port}/metrics").text
    assert _sample(text, "trainer_weight_push_failures_total") == 2
    assert _sample(text, 'trainer_retries_total{reason="grpc_unavailable",target="weights"}') == 1


async def test_a_push_refused_for_its_token_is_not_retried(exporter, tmp_path_factory):
    from services.rollout.engine.hf import HFEngine
    from services.rollout.weights.server import start_weight_server
    from services.transport.weights.client import iter_checkpoint
    from tests.helpers.tiny_model import tiny_model_dir

    model = tiny_model_dir(tmp_path_factory, seed=0)
    engine = HFEngine(model)
    server = await start_weight_server(engine, "127.0.0.1", 0, "the-token")
    try:
        weights = dict(iter_checkpoint(model))
        with pytest.raises(WeightPushError, match="UNAUTHENTICATED"):
            await push_weights(weights, [f"127.0.0.1:{server.port}"], 1, "not-the-token", bucket_bytes=2**20,
                               attempts=3, backoff_s=0)
    finally:
        await server.stop(None)
        await engine.shutdown()
    text = httpx.get(f"http://127.0.0.1:{exporter.port}/metrics").text
    # one attempt: another would send the same token
    assert _sample(text, "trainer_weight_push_failures_total") == 1
    assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("trainer_retries_total{")) == 0
