"""The demo's private queue backends (real redis-server, embedded fakeredis) behave the same
for every stream operation services/common/queue.py performs."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from services.common.queue import RedisStream, connect, publish_and_ack
from services.common.redis_server import PrivateRedis

pytestmark = pytest.mark.integration
BACKENDS = ["fakeredis"] + (["redis-server"] if shutil.which("redis-server") else [])


@pytest.mark.parametrize("backend", BACKENDS)
async def test_stream_operations(tmp_path, backend: str) -> None:
    with PrivateRedis(tmp_path / "redis", backend) as server:  # type: ignore[arg-type]
        assert server.backend == backend
        client = connect(server.url)
        prompts, groups = RedisStream(client, "p", "rollout"), RedisStream(client, "g", "trainer")
        for stream in (prompts, prompts, groups):  # idempotent: BUSYGROUP must not break the connection
            await stream.ensure_group()
        ids = [await prompts.add(b"job%d" % i) for i in range(3)]
        assert await prompts.depth() == 3 and await prompts.lag() == 3

        got = await prompts.read("a", count=2, block_ms=50)
        assert [m.data for m in got] == [b"job0", b"job1"]
        assert await prompts.pending() == 2 and await prompts.backlog() == 3

        other = connect(server.url)  # a blocked reader is woken by an XADD from another client
        waiter = asyncio.create_task(RedisStream(other, "g", "trainer").read("t", block_ms=5000))
        await asyncio.sleep(0.2)
        await publish_and_ack(groups, b"group0", prompts, [got[0].id])
        assert [m.data for m in await asyncio.wait_for(waiter, 5)] == [b"group0"]
        assert await prompts.pending() == 1 and await groups.pending() == 1

        await prompts.touch("a", [got[1].id])
        await asyncio.sleep(0.15)
        claimed = await prompts.claim_stale("b", min_idle_ms=100)
        assert [(m.data, m.deliveries) for m in claimed] == [(b"job1", 2)]
        assert [m.data for m in await prompts.read_own_pending("b")] == [b"job1"]
        assert await prompts.ack(claimed[0].id, delete=True) == 1
        assert await prompts.depth() == 1 and ids[2] not in {m.id for m in claimed}
        await other.aclose()
        await client.aclose()
