"""End to end on vLLM (the CPU build, float32): the twin of test_rl_pipeline.py with ``engine=vllm``.

Real sandbox, reward, Redis and rollout services (the replica serves the ``small`` model on vLLM and
consumes prompt jobs from Redis), and a 2-process gloo trainer under torchrun: validation before
training and at step 3, three GRPO steps, each followed by a weight push into vLLM over gRPC.

The rollout-vs-trainer log-prob mismatch is measured at both ends of the run: responses sampled by
the replica (T = 1, the RL setting) at version 0 against the model it started with, and at the last
version against the trainer's last checkpoint (exported as a Hugging Face model), teacher-forced. The
replica starts from another checkpoint than the trainer (seed 1 vs seed 0), so the first push must
replace every weight: a few RL steps on a random model barely move the weights (all rewards are -1,
advantages 0), which alone could not tell a served push from a lost one. It is
printed and written to ``mismatch.json`` as a metric, and must be float32 noise: the replica serves
exactly the weights the trainer pushed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from services.common.process import ServiceProcess, free_port
from services.common.schemas import Group
from services.transport.weights.client import get_version
from tests.e2e.test_rl_pipeline import TOKEN, _config, _steps, _trainer
from tests.helpers import agent_fixtures
from tests.helpers.engines import VLLM_TEST_KWARGS, load_reference
from tests.helpers.mismatch import logprob_mismatch
from tests.helpers.redis_server import RedisServer
from tests.helpers.tiny_model import tiny_model_dir

pytestmark = pytest.mark.e2e
reward_url = agent_fixtures.reward_url
MISMATCH_MEAN = 1e-4  # float32 noise (measured ~1e-6); a wrong or stale weight gives ~1
MISMATCH_MAX = 1e-3


@pytest.fixture(scope="module")
def stack(tmp_path_factory, sandbox_url, reward_url):
    tmp = tmp_path_factory.mktemp("e2e-vllm")
    redis = RedisServer(tmp / "redis").start()
    model = tiny_model_dir(tmp_path_factory, "small", seed=0)  # head_dim 32: vLLM's CPU attention
    served = tiny_model_dir(tmp_path_factory, "small", seed=1)
    grpc_port = free_port()
    args = ["rollout", "serve", "--model", str(served), "--grpc-port", str(grpc_port),
            "--sandbox-url", sandbox_url, "--reward-url", reward_url, "--redis-url", redis.url,
            "--weight-token-env", "RETOOL_WEIGHT_TOKEN", "--set", "redis.block_ms=100",
            "--set", "engine=vllm"]
    for key, value in VLLM_TEST_KWARGS.items():
        args += ["--set", f"engine_kwargs.{key}={str(value).lower() if isinstance(value, bool) else value}"]
    rollout = ServiceProcess(args, env={"RETOOL_WEIGHT_TOKEN": TOKEN}, log_path=tmp / "rollout.log",
                             startup_timeout_s=300)
    with rollout:
        yield {"tmp": tmp, "redis": redis, "model": model, "served": served, "grpc": f"127.0.0.1:{grpc_port}",
               "http": rollout.url}
    redis.stop()


def _sample(url: str, seed: int) -> Group:
    body = {"messages": [{"role": "user", "content": f"What is {seed} * 7? Use code."}], "n": 2,
            "max_turns": 1, "sampling": {"temperature": 1.0, "max_tokens": 24, "seed": seed}}
    r = httpx.post(url + "/v1/rollouts", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return Group.model_validate(r.json())


def _policy_versions(groups: list[Group]) -> set[int]:
    return {v for g in groups for t in g.trajectories
            for v, m in zip(t.versions, t.loss_mask, strict=True) if m}


async def test_rl_loop_on_vllm_with_exact_weight_pushes(stack):
    tmp = stack["tmp"]
    before = [_sample(stack["http"], s) for s in range(3)]
    assert _policy_versions(before) == {0}

    log = tmp / "trainer.log"
    proc = await _trainer(_config(stack, max_steps=3, save_freq=1), log)
    assert await asyncio.wait_for(proc.wait(), 900) == 0, log.read_text()[-3000:]
    assert await get_version(stack["grpc"]) == 3
    metrics = _steps(tmp / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    for m in (metrics[0], metrics[3]):  # validation through the vLLM replica's HTTP API
        assert "val-core/aime_2025/acc/mean@2" in m and "val-aux/num_turns/mean" in m, sorted(m)
    used = [job for s in _steps(tmp / "groups.jsonl") for job in s["job_ids"]]
    assert len(used) == 6  # 3 steps x 2 prompts, rolled out by vLLM through Redis

    after = [_sample(stack["http"], s) for s in range(3)]
    assert _policy_versions(after) == {3}
    from services.trainer.export import export_hf

    final = export_hf(tmp / "ckpt" / "step_00000003", stack["model"], tmp / "final-hf")
    report: dict[str, Any] = {
        "version_0": logprob_mismatch(load_reference(stack["served"]), before),
        "version_3": logprob_mismatch(load_reference(final), after),
    }
    # the replica's initial weights are gone entirely (every tensor, the tied output layer included)
    report["version_3_vs_initial_weights"] = logprob_mismatch(load_reference(stack["served"]), after)
    (tmp / "mismatch.json").write_text(json.dumps(report, indent=2))
    print("rollout-vs-trainer log-prob mismatch:", json.dumps(report))
    for key in ("version_0", "version_3"):
        assert report[key]["mismatch/abs_mean"] < MISMATCH_MEAN, report
        assert report[key]["mismatch/abs_max"] < MISMATCH_MAX, report
    assert report["version_3_vs_initial_weights"]["mismatch/abs_max"] > 100 * MISMATCH_MAX, report
