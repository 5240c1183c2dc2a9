"""The Redis rollout worker end to end: real Redis, real sandbox, real reward service.

The token stream comes from a scripted engine (a random tiny model cannot be made to write a
correct tool call); everything the worker talks to is real.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from services.common.process import free_port
from services.common.queue import RedisStream, connect
from services.common.schemas import ChatMessage, Group, PromptJob
from services.rollout.agent.loop import AgentLoop
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import AgentConfig, RedisWorkerConfig
from services.rollout.worker import RolloutWorker
from services.transport.reward.client import RewardClient
from services.transport.sandbox.client import SandboxClient
from tests.helpers import agent_fixtures
from tests.helpers.agent_fixtures import ScriptedEngine, make_tokenizer

pytestmark = pytest.mark.integration
reward_url = agent_fixtures.reward_url  # a real reward service (session fixture)

TOK = make_tokenizer()
SCRIPTS: dict[int, list[Any]] = {
    0: ["I'll compute it.\n<code>\n```python\nprint(2 + 2)\n```\n</code>", "So <answer>\\boxed{4}</answer>"],
    1: ["<code>print(1/0)</code>", "Hmm. <answer>\\boxed{5}</answer>"],
    2: [
        "<code>print(sum(range(3))</code>",
        "<code>print(sum(range(5)) - 6)</code>",
        "The sum is four.\nAnswer: 4",  # ends with EOS, which the grader must not see
    ],
}
PROMPTS, GROUPS = "t:prompts", "t:groups"


def _worker(redis_client: Any, sandbox_url: str, reward: str, **cfg: Any) -> tuple[RolloutWorker, list[Any]]:
    engine = ScriptedEngine(TOK, {k: list(v) for k, v in SCRIPTS.items()}, version=5)
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    scorer = RewardClient(reward, timeout_s=5.0)  # an outage is retried for 5 s, then the job fails
    agent = AgentLoop(engine, TOK, sandbox, AgentConfig(), scorer=scorer)
    wcfg = RedisWorkerConfig(
        url="unused",
        prompts_stream=PROMPTS,
        groups_stream=GROUPS,
        consumer="w1",
        block_ms=100,
        **{"claim_idle_ms": 500, "heartbeat_ms": 100, **cfg},
    )
    worker = RolloutWorker(
        agent, RedisStream(redis_client, PROMPTS, "rollout"), RedisStream(redis_client, GROUPS), wcfg
    )
    return worker, [sandbox, scorer]


async def _run_until(worker: RolloutWorker, cond: Any, timeout: float = 60.0) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await cond():
            assert not task.done(), task.exception()
            assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def _job(**kw: Any) -> PromptJob:
    return PromptJob(
        messages=[ChatMessage(role="user", content="What is 2+2?")],
        ground_truth="4",
        n=3,
        policy_version=5,
        meta={"step": 1},
        **kw,
    )


async def test_prompt_job_in_scored_group_out_job_acked(redis_server, sandbox_url, reward_url) -> None:
    client = connect(redis_server.url)
    prompts = RedisStream(client, PROMPTS, "rollout")
    groups = RedisStream(client, GROUPS, "trainer")
    await groups.ensure_group()
    job = _job()
    await prompts.add(job.to_msgpack())
    worker, closers = _worker(client, sandbox_url, reward_url)

    async def written() -> bool:
        return await groups.depth() >= 1

    await _run_until(worker, written)
    (msg,) = await groups.read("t", count=10, block_ms=100)
    group = Group.from_msgpack(msg.data)
    assert group.job_id == job.job_id and group.meta == {"step": 1} and group.job_policy_version == 5
    assert group.prompt_ids == worker.agent.build_prompt([{"role": "user", "content": "What is 2+2?"}])
    t0, t1, t2 = group.trajectories
    assert [t.reward for t in group.trajectories] == [1.0, -1.0, 1.0]
    assert [t.correct for t in group.trajectories] == [True, False, True]
    assert t0.extracted == "4" and t1.extracted == "5"
    # real sandbox output and errors inside the interpreter blocks
    assert "\n<interpreter>\n4\n</interpreter>\n" in t0.response_text
    assert "ZeroDivisionError" in t1.response_text and t1.tool_errors == 1
    assert "SyntaxError" in t2.response_text and "\n<interpreter>\n4\n</interpreter>\n" in t2.response_text
    assert (t2.tool_calls, t2.tool_errors, t2.turns, t2.finish_reason) == (2, 1, 3, "eos")
    assert t2.response_text.endswith("Answer: 4<|im_end|>") and t2.extracted == "4"
    assert (group.min_version, group.max_version) == (5, 5)
    for t in group.trajectories:
        assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        assert TOK.decode(t.response_ids) == t.response_text
    # acknowledged (and removed) only with the group written
    assert await prompts.pending() == 0 and await prompts.depth() == 0
    assert worker.stats.jobs_done == 1
    # a clean stop with nothing pending leaves the consumer group
    assert [c["name"] for c in await client.xinfo_consumers(PROMPTS, "rollout")] == []
    for c in closers:
        await c.aclose()
    await client.aclose()


CRASHING_WORKER = textwrap.dedent("""
    import asyncio, sys
    from services.common.queue import RedisStream, connect

    async def main():
        q = RedisStream(connect(sys.argv[1]), sys.argv[2], "rollout")
        await q.ensure_group()
        got = await q.read("crashed-replica", count=1, block_ms=10000)
        print("HOLDING", len(got), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def test_job_of_a_killed_replica_is_reclaimed_and_completed(
    redis_server, sandbox_url, reward_url
) -> None:
    client = connect(redis_server.url)
    prompts = RedisStream(client, PROMPTS, "rollout")
    groups = RedisStream(client, GROUPS)
    job = _job()
    await prompts.add(job.to_msgpack())
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WORKER, redis_server.url, PROMPTS], stdout=subprocess.PIPE, text=True
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "HOLDING 1"
    finally:
        proc.kill()
        proc.wait(10)
    assert await prompts.pending() == 1
    worker, closers = _worker(client, sandbox_url, reward_url)

    async def written() -> bool:
        return await groups.depth() >= 1

    await _run_until(worker, written)
    raw = await client.xrange(GROUPS)
    assert len(raw) == 1 and Group.from_msgpack(raw[0][1][b"d"]).job_id == job.job_id
    assert worker.stats.jobs_reclaimed == 1 and await prompts.pending() == 0
    for c in closers:
        await c.aclose()
    await client.aclose()


async def test_reward_outage_leaves_job_pending_and_bad_job_goes_to_dead_letter(
    redis_server, sandbox_url
) -> None:
    client = connect(redis_server.url)
    prompts = RedisStream(client, PROMPTS, "rollout")
    groups = RedisStream(client, GROUPS)
    await prompts.add(_job().to_msgpack())
    await prompts.add(b"\x93not-a-job")
    worker, closers = _worker(client, sandbox_url, f"http://127.0.0.1:{free_port()}", claim_idle_ms=60_000)

    async def settled() -> bool:
        return worker.stats.jobs_failed >= 1 and worker.stats.jobs_dead >= 1

    await _run_until(worker, settled)
    assert await groups.depth() == 0  # no group without rewards
    assert await prompts.pending() == 1  # the failed job stays pending for a retry
    # ... held by the stopped consumer, which therefore stays in the group (nothing dropped)
    assert [c["name"] for c in await client.xinfo_consumers(PROMPTS, "rollout")] == [b"w1"]
    dead = await client.xrange(f"{PROMPTS}:dead")
    assert [e[1][b"d"] for e in dead] == [b"\x93not-a-job"]
    for c in closers:
        await c.aclose()
    await client.aclose()


async def test_poison_jobs_go_to_dead_letter(redis_server, sandbox_url, reward_url) -> None:
    client = connect(redis_server.url)
    prompts = RedisStream(client, PROMPTS, "rollout")
    job = _job()
    await prompts.add(job.to_msgpack())
    # held by a replica that died: the next delivery is the second, above max_deliveries=1
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WORKER, redis_server.url, PROMPTS], stdout=subprocess.PIPE, text=True
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "HOLDING 1"
    finally:
        proc.kill()
        proc.wait(10)
    too_long = PromptJob(prompt_ids=[65] * 50, n=1)
    await prompts.add(too_long.to_msgpack())
    worker, closers = _worker(client, sandbox_url, reward_url, max_deliveries=1)
    worker.max_prompt_tokens = 40

    async def settled() -> bool:
        return worker.stats.jobs_dead >= 2

    await _run_until(worker, settled)
    dead = {e[1][b"reason"].decode(): e[1][b"d"] for e in await client.xrange(f"{PROMPTS}:dead")}
    assert dead == {
        "delivered 2 times (max_deliveries=1)": job.to_msgpack(),
        "prompt has 50 tokens, above max_prompt_tokens=40": too_long.to_msgpack(),
    }
    assert await prompts.pending() == 0 and worker.stats.jobs_done == 0
    for c in closers:
        await c.aclose()
    await client.aclose()


async def test_a_broken_engine_takes_no_jobs_until_it_reports_healthy(redis_server, sandbox_url,
                                                                      reward_url) -> None:
    """While the engine says it cannot serve (e.g. vLLM's engine core died), the worker leaves jobs in
    the stream (undelivered, nothing dead-lettered), and takes them once the engine is healthy."""
    client = connect(redis_server.url)
    prompts = RedisStream(client, PROMPTS, "rollout")
    groups = RedisStream(client, GROUPS, "trainer")
    await groups.ensure_group()
    worker, closers = _worker(client, sandbox_url, reward_url)
    state: dict[str, Any] = {"error": "vLLM engine core is dead (EngineDeadError)", "probes": 0}

    def health_error() -> str | None:
        state["probes"] += 1
        return state["error"]

    worker.agent.engine.health_error = health_error
    await prompts.add(_job().to_msgpack())

    async def probed_while_broken() -> bool:  # the worker loop went round a few times
        return state["probes"] >= 5

    await _run_until(worker, probed_while_broken)
    assert await prompts.depth() == 1 and await prompts.pending() == 0  # never delivered
    assert worker.stats.jobs_failed == worker.stats.jobs_dead == 0
    state["error"] = None

    async def written() -> bool:
        return await groups.depth() >= 1

    await _run_until(worker, written)
    assert worker.stats.jobs_done == 1
    for c in closers:
        await c.aclose()
    await client.aclose()
