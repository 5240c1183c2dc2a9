"""Weight push into the real rollout service (``retool rollout serve --grpc-port``) as a subprocess."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from services.common.process import ServiceProcess, free_port
from services.trainer.push import WeightPusher
from services.transport.weights.client import (
    WeightPushError,
    get_version,
    iter_checkpoint,
    push_checkpoint,
    push_checkpoint_async,
)
from tests.helpers.tiny_model import tiny_model_dir

pytestmark = pytest.mark.integration
TOKEN = "svc-push-token-93ab"


def test_push_into_rollout_service_updates_version_and_metrics(tmp_path_factory, tmp_path):
    served, pushed = tiny_model_dir(tmp_path_factory, seed=0), tiny_model_dir(tmp_path_factory, seed=1)
    grpc_port = free_port()
    log = tmp_path / "rollout.log"
    args = ["rollout", "serve", "--model", str(served), "--grpc-port", str(grpc_port)]
    with ServiceProcess(args, env={"RETOOL_WEIGHT_TOKEN": TOKEN}, log_path=log) as svc:
        target = f"127.0.0.1:{grpc_port}"
        with pytest.raises(WeightPushError, match="UNAUTHENTICATED"):
            push_checkpoint(pushed, [target], "not-the-token", version=3)
        assert httpx.get(svc.url + "/healthz").json()["weight_version"] == 0
        report = push_checkpoint(pushed, [target], TOKEN, version=None)
        assert report.version == 1 and report.bytes > 0
        assert httpx.get(svc.url + "/healthz").json()["weight_version"] == 1
        metrics = httpx.get(svc.url + "/metrics").text
        assert "rollout_weight_version 1.0" in metrics
        assert "rollout_weight_load_seconds_count 1.0" in metrics
        assert asyncio.run(get_version(target)) == 1
        asyncio.run(push_checkpoint_async(served, [target], TOKEN, version=7))
        assert httpx.get(svc.url + "/healthz").json()["weight_version"] == 7
        # the trainer's pusher: a full push in the service's serving dtype, then a delta (timed load)
        weights = dict(iter_checkpoint(pushed))
        pusher = WeightPusher([target], TOKEN, bucket_bytes=1 << 20, backoff_s=0)
        first = asyncio.run(pusher.push(weights, 8))
        norm = "model.norm.weight"
        weights[norm] = weights[norm].clone().index_fill(0, torch.tensor([3]), 2.5)
        second = asyncio.run(pusher.push(weights, 9))
        pusher.close()
        assert (first["weights/push_full_targets"], second["weights/push_delta_targets"]) == (1, 1)
        assert second["weights/push_wire_bytes"] == 4 + 4  # one fp32 element and its index
        assert httpx.get(svc.url + "/healthz").json()["weight_version"] == 9
        metrics = httpx.get(svc.url + "/metrics").text
        assert 'rollout_weight_pushes_applied_total{kind="delta"} 1.0' in metrics
        assert "rollout_weight_load_seconds_count 4.0" in metrics  # the delta's load is timed too
    assert TOKEN not in log.read_text()
