"""``retool rollout push-weights`` into a running ``retool rollout serve --grpc-port`` (real processes).

The pushed checkpoint is a second tiny model (another seed): greedy generation must change after
the push, come back after pushing the original weights again, and every generated token must
carry the version that produced it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.process import ServiceProcess, free_port
from tests.helpers.tiny_model import tiny_model_dir

pytestmark = pytest.mark.integration

TOKEN = "push-token-3b9f0e55-keep-out-of-logs"
GREEDY = {
    "messages": [{"role": "user", "content": "Say something."}],
    "n": 1,
    "sampling": {"temperature": 0, "max_tokens": 24},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_model_dir(tmp_path_factory, seed=0), tiny_model_dir(tmp_path_factory, seed=1)


@pytest.fixture(scope="module")
def replica(models, sandbox_url, tmp_path_factory) -> Iterator[tuple[ServiceProcess, int, Path]]:
    log = tmp_path_factory.mktemp("rollout-w") / "rollout.log"
    grpc_port = free_port()
    args = [
        "rollout",
        "serve",
        "--model",
        str(models[0]),
        "--sandbox-url",
        sandbox_url,
        "--grpc-port",
        str(grpc_port),
        "--weight-token-env",
        "PUSH_TOKEN",
    ]
    with ServiceProcess(args, env={"PUSH_TOKEN": TOKEN}, log_path=log, startup_timeout_s=120) as proc:
        yield proc, grpc_port, log
    assert TOKEN not in log.read_text()


def push(
    checkpoint: Path, grpc_port: int, *extra: str, token: str | None = TOKEN
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RETOOL_WEIGHT_TOKEN"}
    if token is not None:
        env["RETOOL_WEIGHT_TOKEN"] = token
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "rollout",
            "push-weights",
            "--checkpoint",
            str(checkpoint),
            "--target",
            f"127.0.0.1:{grpc_port}",
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def greedy(url: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/rollouts", json=GREEDY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["trajectories"][0]


def test_push_swaps_weights_and_tags_tokens_with_the_new_version(replica, models) -> None:
    proc, grpc_port, _ = replica
    before = greedy(proc.url)
    assert set(before["versions"]) == {0}

    res = push(models[1], grpc_port, "--version", "7")
    assert res.returncode == 0, res.stderr
    assert TOKEN not in res.stdout + res.stderr
    assert httpx.get(proc.url + "/healthz").json()["weight_version"] == 7
    other = greedy(proc.url)
    assert set(other["versions"]) == {7}
    assert other["response_ids"] != before["response_ids"]  # other weights, other greedy text

    res = push(models[0], grpc_port)  # no --version: one above the served version
    assert res.returncode == 0, res.stderr
    back = greedy(proc.url)
    assert set(back["versions"]) == {8}
    assert back["response_ids"] == before["response_ids"]  # the original weights again

    metrics = httpx.get(proc.url + "/metrics").text
    assert "rollout_weight_version 8.0" in metrics
    assert "rollout_weight_load_seconds_count 2.0" in metrics


def test_wrong_or_missing_token_is_refused(replica, models) -> None:
    proc, grpc_port, _ = replica
    version = httpx.get(proc.url + "/healthz").json()["weight_version"]
    res = push(models[1], grpc_port, "--version", "99", token="not-the-token")
    assert res.returncode == 1 and "UNAUTHENTICATED" in res.stdout
    res = push(models[1], grpc_port, "--version", "99", token=None)
    assert res.returncode == 2 and "RETOOL_WEIGHT_TOKEN" in res.stderr
    assert httpx.get(proc.url + "/healthz").json()["weight_version"] == version


def test_bad_target_and_checkpoint_are_config_errors(models, tmp_path) -> None:
    res = push(models[1], 1, "--target", "nonsense")
    assert res.returncode == 2 and "host:port" in res.stderr
    res = push(tmp_path / "missing", 1)
    assert res.returncode == 2 and "checkpoint" in res.stderr


def test_serve_refuses_grpc_without_a_token(models, sandbox_url) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RETOOL_WEIGHT_TOKEN"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "rollout",
            "serve",
            "--model",
            str(models[0]),
            "--port",
            str(free_port()),
            "--grpc-port",
            str(free_port()),
            "--sandbox-url",
            sandbox_url,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "grpc_port" in res.stderr and "token" in res.stderr
