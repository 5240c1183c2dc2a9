"""Redis stream queue against a real redis-server: delivery, re-claim after a crash, atomic publish+ack."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from services.common.queue import RedisStream, connect, entry_id, publish_and_ack

pytestmark = pytest.mark.integration

CRASHING_CONSUMER = textwrap.dedent("""
    import asyncio, sys, time
    from services.common.queue import RedisStream, connect

    async def main():
        q = RedisStream(connect(sys.argv[1]), "jobs", "workers")
        got = await q.read("doomed", count=int(sys.argv[2]), block_ms=5000)
        print("READ", len(got), flush=True)
        await asyncio.sleep(3600)  # "working" until killed; never acknowledges

    asyncio.run(main())
""")


async def test_add_read_ack_and_counters(redis_server) -> None:
    client = connect(redis_server.url)
    q = RedisStream(client, "jobs", "workers")
    await q.ensure_group()
    await q.ensure_group()  # idempotent
    ids = [await q.add(f"job-{i}".encode()) for i in range(5)]
    assert await q.depth() == 5 and await q.lag() == 5 and await q.pending() == 0
    got = await q.read("c1", count=3, block_ms=100)
    assert [m.data for m in got] == [b"job-0", b"job-1", b"job-2"] and [m.id for m in got] == ids[:3]
    assert await q.lag() == 2 and await q.pending() == 3 and await q.backlog() == 5
    assert await q.ack(got[0].id) == 1
    assert await q.ack(got[0].id) == 0  # second ack is a no-op
    assert await q.ack(got[1].id, delete=True) == 1
    assert await q.depth() == 4 and await q.pending() == 1
    # Redis < 7's path (no lag in XINFO), run on this server: agrees with its own lag, although
    # job-0 was acknowledged without being deleted (XLEN - entries-read would count it)
    await q.add(b"job-5")
    cursor = next(entry_id(i["last-delivered-id"]) for i in await client.xinfo_groups("jobs"))
    assert await q.count_after(cursor, page=2) == await q.lag() == 3
    # a restart under the same consumer name sees its own unacknowledged entry again
    assert [m.data for m in await q.read_own_pending("c1")] == [b"job-2"]
    assert await q.read("c2", count=10, block_ms=100) == [m for m in await q.read_own_pending("c2")]
    await client.aclose()


async def test_entries_held_by_a_killed_consumer_are_reclaimed_and_none_lost(redis_server) -> None:
    client = connect(redis_server.url)
    q = RedisStream(client, "jobs", "workers")
    await q.ensure_group()
    sent = {f"job-{i}".encode() for i in range(10)}
    for payload in sorted(sent):
        await q.add(payload)
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHING_CONSUMER, redis_server.url, "4"], stdout=subprocess.PIPE, text=True
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "READ 4"
    finally:
        proc.kill()  # the crash: SIGKILL while holding 4 unacknowledged jobs
        proc.wait(10)
    done: list[bytes] = []
    fresh = await q.read("survivor", count=100, block_ms=100)
    assert len(fresh) == 6
    done += [m.data for m in fresh]
    await q.ack(*[m.id for m in fresh])
    # not idle long enough yet: nothing to re-claim
    assert await q.claim_stale("survivor", min_idle_ms=60_000) == []
    await asyncio.sleep(0.3)
    claimed = await q.claim_stale("survivor", min_idle_ms=200, count=100)
    assert len(claimed) == 4
    assert [m.deliveries for m in claimed] == [2, 2, 2, 2]  # once to the dead consumer, once now
    done += [m.data for m in claimed]
    await q.ack(*[m.id for m in claimed])
    assert sorted(done) == sorted(sent) and len(done) == len(sent)
    assert await q.pending() == 0 and await q.lag() == 0
    await client.aclose()


async def test_touch_keeps_live_work_from_being_reclaimed(redis_server) -> None:
    client = connect(redis_server.url)
    q = RedisStream(client, "jobs", "workers")
    await q.ensure_group()
    await q.add(b"long-job")
    (msg,) = await q.read("busy", count=1, block_ms=100)
    for _ in range(3):
        await asyncio.sleep(0.15)
        await q.touch("busy", [msg.id])
    assert await q.claim_stale("thief", min_idle_ms=250) == []
    await asyncio.sleep(0.3)
    assert [m.data for m in await q.claim_stale("thief", min_idle_ms=250)] == [b"long-job"]
    await client.aclose()


async def test_publish_and_ack_is_atomic_and_survives_redis_restart(redis_server) -> None:
    client = connect(redis_server.url)
    jobs = RedisStream(client, "jobs", "workers")
    groups = RedisStream(client, "groups", "trainer")
    await jobs.ensure_group()
    await groups.ensure_group()
    await jobs.add(b"job")
    (msg,) = await jobs.read("w", count=1, block_ms=100)
    await publish_and_ack(groups, b"group-of-job", jobs, [msg.id])
    assert await jobs.pending() == 0 and await jobs.depth() == 0
    await client.aclose()
    redis_server.restart()  # append-only file: the published group is durable
    client = connect(redis_server.url)
    groups = RedisStream(client, "groups", "trainer")
    assert [m.data for m in await groups.read("t", count=5, block_ms=100)] == [b"group-of-job"]
    await client.aclose()
