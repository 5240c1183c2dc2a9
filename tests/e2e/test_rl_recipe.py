"""The reference recipe as configured, end to end: real sandbox, reward and rollout services
(Redis worker, gRPC weight server), Redis, and ``retool trainer run`` as a user starts it.

The policy is a real model whose answer to every prompt is ``\\boxed{d}`` with ``d`` drawn
uniformly from 1..4 (``branching_model_dir``: a bigram model in ordinary weights, sampled by the
real engine), and every ground truth is one of those digits, so about a third of the groups of 4
have equal rewards and dynamic sampling drops them: exactly the situation that stalled issue 15.

- ``test_reference_defaults_run_with_groups_dropped``: every ``TrainerConfig`` default (dynamic
  sampling on, clip 0.2/0.28, token-mean, max_staleness 1, TIS and overlong as the reference sets
  them, lr 1e-6), only the sizes shrunk; 10 steps, groups dropped (from the metrics file), the
  rollout–trainer mismatch reported every step (written to ``mismatch.json`` and printed);
- ``test_tiny_cpu_compose_config_runs_20_steps``: ``deploy/trainer/tiny-cpu.yaml`` unchanged but
  for the compose paths (model, data, Redis, rollout addresses, run directories).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path

import pytest
import yaml

from services.common.process import ServiceProcess, free_port
from services.demo.task import rl_rows, write_parquet
from services.transport.weights.client import get_version
from tests.helpers import agent_fixtures
from tests.helpers.redis_server import RedisServer
from tests.helpers.scripted_model import branching_model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.slow(reason="real RL recipes for tens of steps on CPU", budget_s=850)]
reward_url = agent_fixtures.reward_url
TOKEN = "e2e-recipe-token-9a4e"
TINY_CPU = Path(__file__).resolve().parents[2] / "deploy" / "trainer" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("recipe-model") / "m"
    return branching_model_dir(out, "\\boxed{", ["1", "2", "3", "4"], "}")


@pytest.fixture
def stack(tmp_path, model, sandbox_url, reward_url):
    """A private Redis and rollout replica per test: no run sees another's leftover jobs or groups."""
    grpc_port = free_port()
    redis = RedisServer(tmp_path / "redis").start()
    try:
        with ServiceProcess(
            ["rollout", "serve", "--model", str(model), "--grpc-port", str(grpc_port),
             "--sandbox-url", sandbox_url, "--reward-url", reward_url, "--redis-url", redis.url,
             "--weight-token-env", "RETOOL_WEIGHT_TOKEN", "--set", "redis.block_ms=100",
             "--set", "redis.concurrency=8"],
            env={"RETOOL_WEIGHT_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}, log_path=tmp_path / "rollout.log",
            startup_timeout_s=180,
        ) as rollout:
            yield {"tmp": tmp_path, "redis": redis, "model": model, "grpc": f"127.0.0.1:{grpc_port}",
                   "http": rollout.url}
    finally:
        redis.stop()


def _dataset(path: Path, n: int) -> Path:
    """``What is 1 * b?`` with b in 1..4: short prompts (the compose data's layout), answers 1..4."""
    return write_parquet(path, rl_rows([(1, 1 + i % 4) for i in range(n)], path.stem))


async def _run(config: dict, tmp: Path, name: str) -> list[dict]:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp / f"{name}.log"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "trainer", "run", "--config", str(path),
        stdout=log.open("wb"), stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "RETOOL_WEIGHT_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
    )
    try:
        rc = await asyncio.wait_for(proc.wait(), 600)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rc == 0, log.read_text()[-4000:]
    return [json.loads(x) for x in Path(config["metrics_path"]).read_text().splitlines()]


def _dropped(metrics: list[dict]) -> float:
    return sum(m.get("rollout/dropped_filtered", 0.0) for m in metrics)


async def test_reference_defaults_run_with_groups_dropped(stack):
    tmp = stack["tmp"] / "defaults"
    before = await get_version(stack["grpc"])
    config = {
        "dataset": str(_dataset(tmp / "train.parquet", 60)),
        "redis_url": stack["redis"].url,
        "rollout_targets": [stack["grpc"]],
        "max_steps": 10,
        "metrics_path": str(tmp / "metrics.jsonl"),
        "group_wait_s": 120,
        "sampling": {"max_tokens": 16},
        "max_turns": 1,
        # sizes only: 2 prompts x 4 responses (reference 32 x 16), mini-batch 4 (reference 64: 8
        # optimizer steps per step there, 2 here), prompt/response lengths and checkpoint period
        "trainer": {
            "model_path": str(stack["model"]),
            "batch_prompts": 2,
            "group_size": 4,
            "mini_batch_size": 4,
            "max_prompt_len": 64,
            "max_response_len": 16,
            "micro_batch_max_tokens": 512,
            "save_freq": 5,
            "checkpoint_dir": str(tmp / "ckpt"),
            "fsdp": {"param_dtype": "fp32", "gradient_checkpointing": False},
        },
    }
    metrics = await _run(config, tmp, "defaults")
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 11))
    assert await get_version(stack["grpc"]) == before + 10  # every step's weights reached the replica
    assert _dropped(steps) > 0, "no group was dropped: dynamic sampling was not exercised"
    for m in steps:
        assert 0 < m["rollout/accuracy"] < 1  # only informative groups were trained on
        assert m["rollout/staleness_mean"] <= 1
    keys = ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/k3_kl")
    report = {
        "steps": len(steps),
        "groups_dropped_filtered": _dropped(steps),
        "per_step": [{"step": m["step"], **{k: m[k] for k in keys}} for m in steps],
        "max_abs_mean": max(m["mismatch/abs_mean"] for m in steps),
        "max_abs_max": max(m["mismatch/abs_max"] for m in steps),
        "max_k3_kl": max(m["mismatch/k3_kl"] for m in steps),
    }
    (tmp / "mismatch.json").write_text(json.dumps(report, indent=2))
    print("recipe-defaults mismatch:", json.dumps({k: v for k, v in report.items() if k != "per_step"}))
    for m in steps:  # fp32 engine vs fp32 trainer, a policy at most one version (lr 1e-6) behind
        assert all(math.isfinite(m[k]) for k in keys), m
        assert m["mismatch/abs_max"] < 0.05 and m["mismatch/k3_kl"] < 1e-3, m
    assert (tmp / "ckpt" / "step_00000010").is_dir()


async def test_tiny_cpu_compose_config_runs_20_steps(stack):
    tmp = stack["tmp"] / "tiny-cpu"
    config = yaml.safe_load(TINY_CPU.read_text())
    assert config["trainer"].get("dynamic_sampling", {}).get("enabled", True)  # the default: on
    config.update(  # the compose mounts and service names, pointed at this test's stack
        dataset=str(_dataset(tmp / "rl.parquet", 160)),
        redis_url=stack["redis"].url,
        rollout_targets=[stack["grpc"]],
        rollout_urls=[stack["http"]],
        metrics_path=str(tmp / "metrics.jsonl"),
        metrics_port=free_port(),
        max_steps=20,
    )
    config["trainer"].update(model_path=str(stack["model"]), checkpoint_dir=str(tmp / "ckpt"))
    metrics = await _run(config, tmp, "tiny-cpu")
    assert [m["step"] for m in metrics] == list(range(1, 21))
    assert _dropped(metrics) > 0
    assert {p.name for p in (tmp / "ckpt").iterdir()} >= {"step_00000020"}
