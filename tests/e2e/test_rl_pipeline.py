"""End to end, all real: sandbox, reward and rollout services (tiny model, Redis worker),
Redis, and a 2-process gloo trainer under torchrun.

Phase 1: 3 steps; after each the weights are pushed and the rollout replica's version
advances; checkpoints are written. Phase 2: both trainer ranks are SIGKILLed right after
step 5 (fault injection; last checkpoint: step 4); the restarted trainer resumes from step 4,
redoes step 5 and finishes step 6. Every training step's groups are
logged; the final history must use every admitted job exactly once, and Redis must hold
nothing unacknowledged: no acknowledged group lost, none used twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from services.data.aime import prepare_aime
from services.data.dapo import prepare_dapo
from services.transport.weights.client import get_version
from tests.helpers import agent_fixtures
from tests.helpers.datasets import dapo_row, write_aime_2025, write_dapo
from tests.helpers.ledger_witness import check_ledger_against_redis
from tests.helpers.rl_stack import rl_stack
from tests.helpers.tiny_model import tiny_model_dir
from tests.helpers.torchrun import torchrun_cmd, torchrun_env

pytestmark = pytest.mark.e2e
reward_url = agent_fixtures.reward_url
TOKEN = "e2e-weight-token-51f0"
PROMPTS = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory, sandbox_url, reward_url):
    tmp = tmp_path_factory.mktemp("e2e")
    with rl_stack(tmp, tiny_model_dir(tmp_path_factory), sandbox_url, reward_url, TOKEN) as services:
        yield services


def _config(stack, max_steps: int, save_freq: int) -> Path:
    tmp = stack["tmp"]
    dataset = tmp / "train.parquet"
    if not dataset.exists():
        rows = [dapo_row(f"What is {i} * 7? Use code.", str(i * 7)) for i in range(PROMPTS)]
        prepare_dapo(write_dapo(tmp / "dapo.parquet", rows), dataset, tool_instruction=True)
    val = tmp / "aime.parquet"
    if not val.exists():
        problems = [("0", "Compute 6*7.", "42"), ("1", "Compute 9+9.", "18")]
        prepare_aime(write_aime_2025(tmp / "aime_2025.parquet", problems), val, tool_instruction=True)
    cfg = {
        "val_dataset": str(val),
        "rollout_urls": [stack["http"]],
        "val_sampling": {"top_p": 0.6, "max_tokens": 24},
        "dataset": str(dataset),
        "redis_url": stack["redis"].url,
        "rollout_targets": [stack["grpc"]],
        "max_steps": max_steps,
        "metrics_path": str(tmp / "metrics.jsonl"),
        "groups_log": str(tmp / "groups.jsonl"),
        "group_wait_s": 60,
        "sampling": {"temperature": 1.0, "max_tokens": 24, "seed": 1},
        "max_turns": 1,
        "trainer": {
            "model_path": str(stack["model"]),
            "batch_prompts": 2,
            "group_size": 2,
            "mini_batch_size": 4,
            "max_prompt_len": 1024,
            "max_response_len": 64,
            "micro_batch_max_tokens": 2048,
            "save_freq": save_freq,
            "keep_last_checkpoints": 3,
            "checkpoint_dir": str(tmp / "ckpt"),
            "lr": 1e-4,
            "max_staleness": 100,
            "dynamic_sampling": {"enabled": False},
            "val_n": 2,
            "test_freq": 3,
        },
    }
    path = tmp / f"run-{max_steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _trainer(config: Path, log: Path, **extra_env: str) -> asyncio.subprocess.Process:
    return asyncio.create_subprocess_exec(
        *torchrun_cmd("trainer", "run", "--config", str(config)),
        stdout=log.open("ab"),
        stderr=asyncio.subprocess.STDOUT,
        env=torchrun_env(RETOOL_WEIGHT_TOKEN=TOKEN, **extra_env),
        start_new_session=True,
    )


def _kill_tree(pid: int) -> None:
    """SIGKILL whatever is left of a process tree (torchrun's workers run in their own sessions)."""
    for child in Path(f"/proc/{pid}/task").glob("*/children"):
        for cpid in child.read_text().split():
            _kill_tree(int(cpid))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _steps(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


async def test_rl_loop_end_to_end_with_crash_and_resume(stack):
    tmp = stack["tmp"]
    log = tmp / "trainer.log"
    proc = await _trainer(_config(stack, max_steps=3, save_freq=1), log)
    assert await asyncio.wait_for(proc.wait(), 600) == 0, log.read_text()[-3000:]
    assert await get_version(stack["grpc"]) == 3
    metrics = _steps(tmp / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    for m in (metrics[0], metrics[3]):  # validation before training and every test_freq steps
        assert "val-core/aime_2025/acc/mean@2" in m and "val-aux/num_turns/mean" in m, sorted(m)
    assert {p.name for p in (tmp / "ckpt").iterdir()} >= {"step_00000003"}

    # both ranks die by SIGKILL right after step 5 (last checkpoint: step 4); torchrun gives up
    proc = await _trainer(_config(stack, max_steps=6, save_freq=2), log, RETOOL_FAULT_KILL_AFTER_STEP="5")
    assert await asyncio.wait_for(proc.wait(), 600) != 0
    _kill_tree(proc.pid)
    assert any(s["step"] == 5 for s in _steps(tmp / "groups.jsonl"))
    assert (tmp / "ckpt" / "step_00000004").is_dir() and not (tmp / "ckpt" / "step_00000005").exists()

    proc = await _trainer(_config(stack, max_steps=6, save_freq=2), log)
    assert await asyncio.wait_for(proc.wait(), 600) == 0, log.read_text()[-3000:]
    assert "(step 4, version 4)" in log.read_text()  # resumed from the last checkpoint before the crash
    assert await get_version(stack["grpc"]) == 6

    final: dict[int, list[str]] = {}
    for entry in _steps(tmp / "groups.jsonl"):  # a replayed step overrides its lost first attempt
        final[entry["step"]] = entry["job_ids"]
    assert sorted(final) == [1, 2, 3, 4, 5, 6]
    used = [job for step in sorted(final) for job in final[step]]
    assert len(used) == len(set(used)) == PROMPTS  # every admitted job trained on exactly once
    # the training ledger tells the same story: three runs, a crash after step 5, nothing twice
    from services.trainer.ledger import check_file

    report = check_file(tmp / "ckpt" / "ledger.jsonl")
    assert report.ok, report.violations
    assert report.resumes == [0, 3, 4] and report.steps == 6 and report.ended
    assert report.steps_redone == 1 and report.trained_groups == PROMPTS
    from services.common.queue import RedisStream, connect

    client = connect(stack["redis"].url)
    try:
        groups = RedisStream(client, "retool:groups", "trainer")
        assert await groups.pending() == 0  # nothing left unacknowledged
        # a second witness: groups_log and the ledger are written from the same trainer bookkeeping;
        # Redis counts on its own what the trainer acknowledged (after each checkpoint)
        witness = await check_ledger_against_redis(client, tmp / "ckpt" / "ledger.jsonl",
                                                   groups_stream="retool:groups",
                                                   dead_stream="retool:prompts:dead", group="trainer")
        assert witness.acknowledged >= PROMPTS  # every trained group (and any duplicate) acknowledged
    finally:
        await client.aclose()
