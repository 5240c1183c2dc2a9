"""Admission control, staleness and ack-after-commit against a real Redis server."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from services.common.queue import RedisStream, connect
from services.common.schemas import Group, PromptJob, Trajectory
from services.trainer.feed import GroupReader, PromptFeeder
from services.trainer.staleness import StalenessManager

pytestmark = pytest.mark.integration


def test_staleness_rule_and_capacity():
    m = StalenessManager(batch_prompts=4, max_staleness=1)
    assert m.capacity() == 8 and m.admit(10) == 8 and m.capacity() == 0
    m.advance(1)
    assert m.capacity() == 4
    assert not m.is_stale(0) and m.is_stale(-1)
    m.advance(3)
    assert m.is_stale(1) and not m.is_stale(2)
    with pytest.raises(ValueError, match="went back"):
        m.advance(2)
    clone = StalenessManager(4, 1)
    clone.load_state_dict(m.state_dict())
    assert clone.capacity() == m.capacity()


def _group(job_id: str, version: int, rewards: list[float]) -> Group:
    trajs = [
        Trajectory(
            index=i,
            response_ids=[5, 6],
            loss_mask=[1, 1],
            logprobs=[-0.5, -0.5],
            versions=[version, version],
            finish_reason="eos",
            reward=r,
        )
        for i, r in enumerate(rewards)
    ]
    return Group(
        job_id=job_id,
        prompt_ids=[1, 2, 3],
        trajectories=trajs,
        min_version=version,
        max_version=version,
        job_policy_version=version,
    )


async def _groups_stream(redis_url: str, count: int) -> tuple[Redis, RedisStream]:
    """A fresh groups stream with a ``trainer`` consumer group holding groups g0..g{count-1}."""
    client = connect(redis_url)
    stream = RedisStream(client, "groups", "trainer")
    await stream.ensure_group()
    for i in range(count):
        await stream.add(_group(f"g{i}", 0, [1, -1]).to_msgpack())
    return client, stream


async def test_feeder_never_admits_more_than_the_staleness_budget(redis_server):
    client = connect(redis_server.url)
    prompts = RedisStream(client, "prompts")
    dataset = [PromptJob(job_id=f"p{i}", prompt_ids=[1, i + 2], n=2) for i in range(10)]
    manager = StalenessManager(batch_prompts=2, max_staleness=1)
    feeder = PromptFeeder(prompts, dataset, manager)
    assert await feeder.top_up() == 4 and await feeder.top_up() == 0
    assert await prompts.depth() == 4
    manager.advance(1)
    assert await feeder.top_up() == 2 and feeder.cursor == 6
    restored = PromptFeeder(prompts, dataset, StalenessManager(2, 1))
    restored.load_state_dict(feeder.state_dict())
    assert await restored.top_up() == 0  # a restart neither re-admits nor forgets
    restored.manager.advance(5)
    assert await restored.top_up() == 4 and restored.exhausted
    jobs = [PromptJob.from_msgpack(fields[b"d"]) for _, fields in await client.xrange("prompts")]
    assert [j.job_id for j in jobs] == [f"p{i}:{i}" for i in range(10)]
    await client.aclose()


async def test_stale_duplicate_and_filtered_groups_are_dropped_and_counted(redis_server):
    client = connect(redis_server.url)
    stream = RedisStream(client, "groups", "trainer")
    await stream.ensure_group()
    for g in (
        _group("a", 5, [1, -1]),
        _group("b", 2, [1, -1]),
        _group("a", 5, [1, -1]),
        _group("c", 5, [1, 1]),
        _group("d", 4, [-1, 1]),
    ):
        await stream.add(g.to_msgpack())
    manager = StalenessManager(batch_prompts=2, max_staleness=1, version=5, admitted=15)
    reader = GroupReader(stream, "t0", manager)
    batch = await reader.next_batch(
        2, keep=lambda g: len(set(g.rewards)) > 1, block_ms=100, max_wait_rounds=2
    )
    assert [g.job_id for g in batch.groups] == ["a", "d"]
    assert batch.dropped == {"stale": 1, "duplicate": 1, "filtered": 1}
    assert batch.staleness == [0, 1]
    # the stale and the filtered group gave their slots back; the duplicate changed nothing
    assert manager.admitted == 13 and manager.in_flight(held=2) == 1
    assert reader.state_dict()["seen"] == ["a", "b", "c", "d"]  # a second copy of b/c is a duplicate
    # every entry, dropped ones included, is acknowledged with the commit (the checkpoint that
    # holds the returned slots), so a crash before it resolves the drops again instead of losing them
    assert await stream.pending() == 5
    assert await reader.commit() == 5 and await stream.pending() == 0
    await client.aclose()


async def test_groups_are_acknowledged_only_on_commit_and_survive_a_crash(redis_server):
    client, stream = await _groups_stream(redis_server.url, 3)
    first = GroupReader(stream, "trainer-0", StalenessManager(2, 1))
    batch = await first.next_batch(2, block_ms=100)
    assert [g.job_id for g in batch.groups] == ["g0", "g1"]
    # the trainer dies before committing; Redis itself restarts too (append-only file on)
    redis_server.restart()
    await client.aclose()
    client = connect(redis_server.url)
    stream = RedisStream(client, "groups", "trainer")
    again = GroupReader(stream, "trainer-0", StalenessManager(2, 1))  # same consumer name
    redelivered = await again.next_batch(2, block_ms=100)
    assert [g.job_id for g in redelivered.groups] == ["g0", "g1"]
    assert await again.commit() == 2
    rest = await again.next_batch(2, block_ms=100, max_wait_rounds=2)
    assert [g.job_id for g in rest.groups] == ["g2"]
    await again.commit()
    assert await stream.pending() == 0 and await stream.depth() == 0
    await client.aclose()


async def test_a_long_pending_list_is_redelivered_in_full_after_a_restart(redis_server):
    """More uncommitted groups than one read asks for (save_freq steps of them): none stays stuck."""
    client, stream = await _groups_stream(redis_server.url, 7)
    first = GroupReader(stream, "trainer-0", StalenessManager(2, 10))
    for _ in range(3):  # three steps' batches used, no checkpoint yet
        await first.next_batch(2, block_ms=100)
    again = GroupReader(stream, "trainer-0", StalenessManager(2, 10))  # restarted
    got = []
    for _ in range(4):
        got += [g.job_id for g in (await again.next_batch(2, block_ms=100, max_wait_rounds=1)).groups]
    assert got == [f"g{i}" for i in range(7)]
    assert await again.commit() == 7 and await stream.pending() == 0
    await client.aclose()


async def test_a_released_batch_stays_pending_and_is_used_after_a_restart(redis_server):
    client, stream = await _groups_stream(redis_server.url, 3)
    reader = GroupReader(stream, "trainer-0", StalenessManager(2, 10))
    used = await reader.next_batch(2, block_ms=100)
    partial = await reader.next_batch(2, block_ms=100, max_wait_rounds=1)  # only g2 there: a stop comes
    assert [g.job_id for g in partial.groups] == ["g2"]
    reader.release(partial)
    state = reader.state_dict()  # what the checkpoint holds
    assert state["seen"] == ["g0", "g1"]
    assert await reader.commit() == 2  # the used batch only
    assert await stream.pending() == 1
    again = GroupReader(stream, "trainer-0", StalenessManager(2, 10))
    again.load_state_dict(state)
    redelivered = await again.next_batch(1, block_ms=100)
    assert [g.job_id for g in redelivered.groups] == ["g2"] and not redelivered.dropped
    assert [g.job_id for g in used.groups] == ["g0", "g1"]
    await client.aclose()
