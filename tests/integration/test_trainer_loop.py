"""``retool trainer run`` as a real process: Redis streams, FSDP step, weight push, resume.

Groups come from a scripted producer that plays the rollout side of the streams (it reads
the real prompt jobs the trainer admits and answers each with a scored group); the weights
go over real gRPC into a real transformers engine. The full rollout→trainer path with the
rollout service generating is the end-to-end test's job.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys

import pytest
import torch
import yaml

from services.common.queue import RedisStream, connect, publish_and_ack
from services.common.schemas import Group, PromptJob, Trajectory
from services.data.dapo import prepare_dapo
from services.rollout.engine.hf import HFEngine
from services.rollout.weights.server import start_weight_server
from tests.helpers.datasets import dapo_row, write_dapo
from tests.helpers.tiny_model import tiny_model_dir

pytestmark = pytest.mark.integration
TOKEN = "trainer-loop-token-9c2"


async def _produce(
    redis_url: str, stop: asyncio.Event, seen: list[str], limit: list[int | None] | None = None
) -> None:
    """Answer every prompt job with a scored group; only ``limit[0]`` jobs in all when it is set."""
    limit = limit if limit is not None else [None]
    client = connect(redis_url)
    prompts = RedisStream(client, "retool:prompts", "rollout")
    groups = RedisStream(client, "retool:groups")
    await prompts.ensure_group()
    rng = random.Random(0)
    while not stop.is_set():
        count = 4 if limit[0] is None else min(4, limit[0] - len(seen))
        if count <= 0:
            await asyncio.sleep(0.1)
            continue
        for m in await prompts.read("scripted", count=count, block_ms=200):
            job = PromptJob.from_msgpack(m.data)
            seen.append(job.job_id)
            trajs = []
            for i in range(job.n):
                n = rng.randint(4, 12)
                trajs.append(
                    Trajectory(
                        index=i,
                        response_ids=[rng.randint(5, 200) for _ in range(n)],
                        loss_mask=[1] * n,
                        logprobs=[-2.0] * n,
                        versions=[max(job.policy_version, 0)] * n,
                        finish_reason="eos",
                        reward=1.0 if i % 2 == 0 else -1.0,
                        turns=1,
                    )
                )
            group = Group(
                job_id=job.job_id,
                prompt_ids=[1, 2, 3, 4],
                trajectories=trajs,
                min_version=max(job.policy_version, 0),
                max_version=max(job.policy_version, 0),
                job_policy_version=job.policy_version,
            )
            await publish_and_ack(groups, group.to_msgpack(), prompts, [m.id])
    await client.aclose()


def _config(tmp_path, model_dir, redis_url, target, max_steps):
    rows = [dapo_row(f"What is {i} + {i}?", str(2 * i)) for i in range(12)]
    dataset = tmp_path / "train.parquet"
    if not dataset.exists():
        prepare_dapo(write_dapo(tmp_path / "dapo.parquet", rows), dataset)
    cfg = {
        "dataset": str(dataset),
        "redis_url": redis_url,
        "rollout_targets": [target],
        "weight_token_env": "RETOOL_WEIGHT_TOKEN",
        "max_steps": max_steps,
        "metrics_path": str(tmp_path / "metrics.jsonl"),
        "group_wait_s": 60,
        "trainer": {
            "model_path": str(model_dir),
            "batch_prompts": 2,
            "group_size": 2,
            "mini_batch_size": 4,
            "max_prompt_len": 64,
            "max_response_len": 64,
            "micro_batch_max_tokens": 256,
            "save_freq": 1,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "lr": 1e-4,
            "max_staleness": 1,
        },
    }
    path = tmp_path / f"run-{max_steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
async def replica(tmp_path_factory, redis_server):
    """A real engine behind a real weight server, and the scripted rollout side of the streams."""
    model_dir = tiny_model_dir(tmp_path_factory)
    engine = HFEngine(model_dir)
    server = await start_weight_server(engine, "127.0.0.1", 0, TOKEN)
    stop, seen, limit = asyncio.Event(), [], [None]
    producer = asyncio.create_task(_produce(redis_server.url, stop, seen, limit))
    try:
        yield {"engine": engine, "target": f"127.0.0.1:{server.port}", "model": model_dir, "seen": seen,
               "answer_limit": limit}
    finally:
        stop.set()
        await producer
        await server.stop(None)
        await engine.shutdown()


def _start_trainer(config_path, stdout=asyncio.subprocess.PIPE):
    return asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "trainer",
        "run",
        "--config",
        str(config_path),
        stdout=stdout,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "RETOOL_WEIGHT_TOKEN": TOKEN},
    )


async def _run_trainer(config_path) -> tuple[int, str]:
    proc = await _start_trainer(config_path)
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode, out.decode()


async def test_trains_pushes_checkpoints_and_resumes(tmp_path, redis_server, replica):
    engine = replica["engine"]
    rc, out = await _run_trainer(_config(tmp_path, replica["model"], redis_server.url, replica["target"], 3))
    assert rc == 0, out
    assert engine.version == 3  # one push per step, version bumped each time
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(m["weights/push_seconds"] > 0 and "actor/pg_loss" in m for m in lines)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ledger.jsonl", "step_00000002",
                                                                      "step_00000003"]
    # admission control: never more than (max_staleness + version + 1) * batch_prompts jobs
    assert len(replica["seen"]) <= (1 + 3 + 1) * 2

    rc, out = await _run_trainer(_config(tmp_path, replica["model"], redis_server.url, replica["target"], 5))
    assert rc == 0, out
    assert "resumed from" in out
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert lines[3]["policy/version"] == 4.0 and engine.version == 5
    client = connect(redis_server.url)
    groups = RedisStream(client, "retool:groups", "trainer")
    assert await groups.pending() == 0  # everything used was acknowledged after its checkpoint
    await client.aclose()

    # the exported checkpoint is exactly what the replica was serving after the last push
    out_dir = tmp_path / "hf"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "trainer",
        "export",
        "--checkpoint",
        str(tmp_path / "ckpt" / "step_00000005"),
        "--model",
        str(replica["model"]),
        "--out",
        str(out_dir),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(out_dir).state_dict()
    served = engine.model.state_dict()
    assert set(exported) == set(served)
    assert all(torch.equal(exported[k].float(), served[k].float()) for k in served)
    assert AutoTokenizer.from_pretrained(out_dir).eos_token == "<|im_end|>"


def _set(config, **trainer) -> None:
    cfg = yaml.safe_load(config.read_text())
    cfg["trainer"].update(trainer)
    config.write_text(yaml.safe_dump(cfg))


async def test_sigterm_checkpoints_the_current_step_and_exits_cleanly(tmp_path, redis_server, replica):
    config = _config(tmp_path, replica["model"], redis_server.url, replica["target"], 50)
    _set(config, save_freq=100, total_epochs=10)  # data for 60 steps: only the signal ends it before 50
    log = tmp_path / "trainer.log"
    with log.open("wb") as out:
        proc = await _start_trainer(config, stdout=out)
    metrics = tmp_path / "metrics.jsonl"
    for _ in range(600):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        await asyncio.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 120) == 0, log.read_text()
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert 2 <= last < 50
    assert f"SIGTERM: checkpoint written at step {last}" in log.read_text()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ledger.jsonl", f"step_{last:08d}"]


async def test_sigterm_while_waiting_for_groups_keeps_the_partial_batch_for_the_resumed_run(
    tmp_path, redis_server, replica
):
    """Stopped with 1 of 2 groups in hand: it exits cleanly and the restarted trainer trains on that group."""
    replica["answer_limit"][0] = 3  # step 1 gets its 2 groups; step 2 only one
    config = _config(tmp_path, replica["model"], redis_server.url, replica["target"], 3)
    cfg = yaml.safe_load(config.read_text())
    cfg["groups_log"] = str(tmp_path / "groups.jsonl")
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "trainer.log"
    with log.open("wb") as out:
        proc = await _start_trainer(config, stdout=out)
    client = connect(redis_server.url)
    groups = RedisStream(client, "retool:groups", "trainer")
    metrics = tmp_path / "metrics.jsonl"
    for _ in range(600):  # step 1 done and committed, the third group delivered to the trainer
        started = metrics.exists() and metrics.read_text().strip() and len(replica["seen"]) == 3
        if started and await groups.pending() == 1:
            break
        await asyncio.sleep(0.1)
    held = replica["seen"][2]
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 120) == 0, log.read_text()
    assert "releasing 1 held" in log.read_text() and "checkpoint written at step 1" in log.read_text()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ledger.jsonl", "step_00000001"]
    assert await groups.pending() == 1  # neither acknowledged nor lost

    replica["answer_limit"][0] = None
    rc, out = await _run_trainer(config)
    assert rc == 0, out
    used = [json.loads(x) for x in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert [u["step"] for u in used] == [1, 2, 3]
    assert held in used[1]["job_ids"]  # trained on at step 2, not dropped as a duplicate
    assert await groups.pending() == 0
    await client.aclose()


async def test_two_ranks_train_with_the_feed_overlapping_the_update(tmp_path, redis_server, replica):
    """``trainer.feed_overlap`` under torchrun (2 ranks, gloo): the update runs in a worker thread
    on every rank while rank 0 reads the next batch; collectives stay in order (one thread each)."""
    from tests.helpers.torchrun import torchrun_cmd, torchrun_env

    config = _config(tmp_path, replica["model"], redis_server.url, replica["target"], 3)
    _set(config, feed_overlap=True, save_freq=2)
    proc = await asyncio.create_subprocess_exec(
        *torchrun_cmd("trainer", "run", "--config", str(config)), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env=torchrun_env(RETOOL_WEIGHT_TOKEN=TOKEN))
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, out.decode()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and replica["engine"].version == 3
    assert all("perf/feed_wait_seconds" in m for m in lines)
    # steps 2 and 3 were read ahead during the update before them; step 1 had nothing before it
    overlapped = [m["perf/feed_overlap_seconds"] for m in lines]
    assert overlapped[0] == 0.0 and all(s > 0 for s in overlapped[1:])
    client = connect(redis_server.url)
    assert await RedisStream(client, "retool:groups", "trainer").pending() == 0
    await client.aclose()
