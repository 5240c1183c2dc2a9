"""Hand-back of a draining replica's jobs on real Redis: the queue primitives
(services/rollout/handback.py) and the worker's drain (services/rollout/worker.py).

The engine is a paced test engine (one token every ``PACE_S``: a job is still generating when the
drain begins); Redis, the agent loop and the worker are real. The sandbox is never called (the
paced engine writes no code).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common.queue import RedisStream, connect
from services.common.schemas import Group, PromptJob
from services.rollout.agent.drain import SampleDrained
from services.rollout.agent.loop import AgentLoop
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import AgentConfig, RedisWorkerConfig
from services.rollout.engine.base import GenerationChunk, SamplingParams
from services.rollout.handback import HANDED_BACK, hand_back, take_handed_back
from services.rollout.worker import RolloutWorker
from services.transport.sandbox.client import SandboxClient
from tests.helpers.agent_fixtures import make_tokenizer

pytestmark = pytest.mark.integration

TOK = make_tokenizer()
PROMPTS, GROUPS, GROUP = "h:prompts", "h:groups", "rollout"
CLAIM_IDLE_MS = 600_000  # far longer than any test here: a job taken in time was not re-claimed
PACE_S = 0.02


class PacedEngine:
    """One token every ``pace_s`` until ``max_tokens`` (finish ``length``)."""

    def __init__(self, pace_s: float = PACE_S) -> None:
        self.pace_s = pace_s
        self.version = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[GenerationChunk]:
        tok = TOK.encode("a", add_special_tokens=False)[0]
        for i in range(params.max_tokens):
            await asyncio.sleep(self.pace_s)
            last = i == params.max_tokens - 1
            yield GenerationChunk(index=0, token_ids=[tok], logprobs=[-0.5], versions=[0], finished=last,
                                  finish_reason="length" if last else None)

    async def load_weights(self, named_tensors: Any, version: int) -> None:
        self.version = version

    async def shutdown(self) -> None:
        return None


class DrainedAtTurnBoundary(AgentLoop):
    """The loop's side of the drain contract (services/rollout/agent/drain.py), as a test double:
    ``run_group`` raises ``SampleDrained`` once ``draining`` is set."""

    async def run_group(self, prompt_ids: list[int], n: int, **kwargs: Any) -> Any:
        await self.draining.wait()
        raise SampleDrained("turn boundary")


def _worker(client: Any, consumer: str, agent_cls: type[AgentLoop] = AgentLoop, **cfg: Any) -> RolloutWorker:
    agent = agent_cls(PacedEngine(), TOK, SandboxTool(SandboxClient("http://127.0.0.1:9")), AgentConfig())
    wcfg = RedisWorkerConfig(url="unused", prompts_stream=PROMPTS, groups_stream=GROUPS, consumer=consumer,
                             **{"block_ms": 100, "claim_idle_ms": CLAIM_IDLE_MS, "heartbeat_ms": 100,
                                "drain_s": 0.5, "concurrency": 2, **cfg})
    return RolloutWorker(agent, RedisStream(client, PROMPTS, GROUP), RedisStream(client, GROUPS), wcfg)


def _job(max_tokens: int) -> PromptJob:
    return PromptJob(prompt_ids=[1, 2, 3], n=2, sampling={"max_tokens": max_tokens}, policy_version=0)


async def _until(cond: Any, what: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not reached in {timeout} s"
        await asyncio.sleep(0.02)


async def _running(client: Any, jobs: list[PromptJob], stop: asyncio.Event | None = None,
                   **kw: Any) -> tuple[RolloutWorker, asyncio.Task[None]]:
    """Replica ``a`` (``_worker`` settings ``kw``) running every one of ``jobs``."""
    prompts = RedisStream(client, PROMPTS, GROUP)
    await prompts.ensure_group()
    for j in jobs:
        await prompts.add(j.to_msgpack())
    a = _worker(client, "a", **kw)
    task = asyncio.create_task(a.run(stop or asyncio.Event()))

    async def running() -> bool:
        return a.stats.in_flight == len(jobs)
    await _until(running, "replica a running every job")
    return a, task


async def _pending_of(client: Any, consumer: str) -> list[dict[str, Any]]:
    return await client.xpending_range(PROMPTS, GROUP, min="-", max="+", count=100, consumername=consumer)


async def _published(client: Any) -> list[str]:
    return [Group.from_msgpack(f[b"d"]).job_id for _, f in await client.xrange(GROUPS)]


async def test_hand_back_keeps_the_delivery_count_and_each_job_goes_to_one_taker(redis_server) -> None:
    client = connect(redis_server.url)
    q = RedisStream(client, PROMPTS, GROUP)
    await q.ensure_group()
    ids = [await q.add(_job(4).to_msgpack()) for _ in range(5)]
    failed = await q.add(_job(4).to_msgpack())  # a job that failed here: not handed back
    assert len(await q.read("a", count=6)) == 6
    await client.xclaim(PROMPTS, GROUP, "a", 0, [ids[0]])  # job 0 delivered twice (a re-claim)

    assert await hand_back(q, "a", CLAIM_IDLE_MS, [*ids, "1-1"], page=2) == 5  # paged; 1-1: not pending
    assert [r["message_id"].decode() for r in await _pending_of(client, "a")] == [failed]
    rows = await _pending_of(client, HANDED_BACK)
    assert {r["message_id"].decode() for r in rows} == set(ids)
    # ready for any claim at once, and the drain's delivery not counted
    assert all(r["time_since_delivered"] >= CLAIM_IDLE_MS for r in rows)
    assert {r["message_id"].decode(): r["times_delivered"] for r in rows} == {
        i: 1 if i == ids[0] else 0 for i in ids}

    # concurrent takers: every entry to exactly one of them, at its delivery count again
    takes = await asyncio.gather(*(take_handed_back(q, c, CLAIM_IDLE_MS, 5) for c in ("b", "c", "d")))
    taken = [p for t in takes for p in t]
    assert sorted(p.msg.id for p in taken) == sorted(ids)
    assert {p.msg.id: p.msg.deliveries for p in taken} == {i: 2 if i == ids[0] else 1 for i in ids}
    assert all(0 <= p.waited_s < 60 for p in taken)
    assert await take_handed_back(q, "e", CLAIM_IDLE_MS, 5) == []
    assert await q.pending() == 6  # still pending (at-least-once): acked only with a group
    await client.aclose()


async def test_a_replica_that_never_looks_for_hand_backs_still_claims_them_at_once(redis_server) -> None:
    client = connect(redis_server.url)
    q = RedisStream(client, PROMPTS, GROUP)
    await q.ensure_group()
    entry = await q.add(_job(4).to_msgpack())
    await q.read("a", count=1)
    await hand_back(q, "a", CLAIM_IDLE_MS, [entry])
    (msg,) = await q.claim_stale("old", min_idle_ms=CLAIM_IDLE_MS, count=10)  # XAUTOCLAIM, as before
    assert msg.id == entry and msg.deliveries == 1
    await client.aclose()


async def test_drain_hands_running_jobs_back_and_another_replica_takes_them_before_new_prompts(
        redis_server) -> None:
    client = connect(redis_server.url)
    prompts = RedisStream(client, PROMPTS, GROUP)
    first = [_job(max_tokens=400) for _ in range(2)]  # 8 s of generation each: running at the drain
    a, run_a = await _running(client, first, drain_s=0.3)
    later = [_job(max_tokens=2) for _ in range(2)]  # queued behind: b must take the handed-back ones first
    for j in later:
        await prompts.add(j.to_msgpack())

    a.begin_drain()
    assert a.agent.draining.is_set()
    await asyncio.wait_for(run_a, 30)  # drain_s, then cancelled and handed back
    assert a.stats.jobs_handed_back == 2 and a.stats.jobs_done == 0
    assert [c["name"] for c in await client.xinfo_consumers(PROMPTS, GROUP)] == [HANDED_BACK.encode()]

    b = _worker(client, "b", concurrency=1)
    b.agent.engine.pace_s = 0.0005
    waits: list[float] = []
    b.on_taken_over = waits.append
    stop_b = asyncio.Event()
    run_b = asyncio.create_task(b.run(stop_b))

    async def all_published() -> bool:
        return len(await _published(client)) >= 4
    try:
        await _until(all_published, "every job published by replica b")
    finally:
        stop_b.set()
        await asyncio.wait_for(run_b, 30)
    published = await _published(client)
    assert sorted(published) == sorted(j.job_id for j in first + later)  # each exactly once
    assert set(published[:2]) == {j.job_id for j in first}  # handed-back jobs first
    assert b.stats.jobs_taken_over == 2 and b.stats.jobs_reclaimed == 0 and len(waits) == 2
    assert await prompts.pending() == 0
    await client.aclose()


async def test_a_sample_drained_at_its_turn_boundary_is_handed_back_without_waiting_drain_s(
        redis_server) -> None:
    client = connect(redis_server.url)
    a, run_a = await _running(client, [_job(4)], agent_cls=DrainedAtTurnBoundary, drain_s=600)
    a.begin_drain()
    await asyncio.wait_for(run_a, 60)  # well before drain_s: the sample stopped at its boundary
    assert (a.stats.jobs_handed_back, a.stats.jobs_failed, a.stats.jobs_done) == (1, 0, 0)
    assert len(await _pending_of(client, HANDED_BACK)) == 1 and await client.xlen(GROUPS) == 0
    await client.aclose()


async def test_stop_during_a_drain_cuts_it_short_and_still_hands_back(redis_server) -> None:
    client = connect(redis_server.url)
    stop = asyncio.Event()
    a, run_a = await _running(client, [_job(100_000)], stop, drain_s=600)  # never finishes on its own
    a.begin_drain()
    await asyncio.sleep(0.3)  # the drain is under way (not a wait for a condition: any length works)
    assert not run_a.done()
    stop.set()  # the second signal
    await asyncio.wait_for(run_a, 60)
    assert a.stats.jobs_handed_back == 1 and len(await _pending_of(client, HANDED_BACK)) == 1
    await client.aclose()
