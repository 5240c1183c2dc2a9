"""What the trainer does about jobs that never come back, against a real Redis server.

- jobs lost with Redis (AOF everysec loses up to a second; here: their entries deleted, the same
  end state) are found by ``PromptFeeder.vanished`` and pushed again under their own ids, while
  jobs that are queued, being generated, turned into a group or dead-lettered are left alone;
- jobs a rollout replica dead-lettered are resolved by the trainer's ``_collect`` with the
  replica's reason (admission slot given back, ledger ``drop dead_lettered``), so the run goes
  on instead of waiting for them;
- a trainer's Redis client rides out a restart of the server (same port, same data).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from services.common.queue import RedisStream, connect, publish_and_ack
from services.common.schemas import PromptJob
from services.trainer.config import TrainerConfig
from services.trainer.feed import PromptFeeder, job_id_of
from services.trainer.ledger import LedgerWriter, check_file
from services.trainer.loop import Trainer
from services.trainer.staleness import StalenessManager
from tests.helpers.ledger_witness import StreamWitness, check_ledger_against_redis, stream_witness
from tests.integration.test_trainer_admission import LoopUnderTest, ScriptedRollout, _group, _jobs, run_config

pytestmark = pytest.mark.integration


async def test_vanished_jobs_are_found_and_reissued_and_nothing_else(redis_server, tmp_path):
    client = connect(redis_server.url)
    prompts = RedisStream(client, "prompts", "rollout")
    await prompts.ensure_group()
    groups = RedisStream(client, "groups", "trainer")
    await groups.ensure_group()
    dead = RedisStream(client, "prompts:dead")
    ledger = LedgerWriter(tmp_path / "ledger.jsonl")
    feeder = PromptFeeder(prompts, _jobs(6, 2), StalenessManager(3, 1), ledger=ledger)
    assert await feeder.top_up() == 6
    msgs = await prompts.read("w0", count=6)
    ids = {PromptJob.from_msgpack(m.data).job_id: m.id for m in msgs}
    # p0: a group written (atomically with its ack); p1: dead-lettered; p2, p3: lost with Redis;
    # p4: being generated (pending); p5: delivered and pending too
    by_id = {PromptJob.from_msgpack(m.data).job_id: m for m in msgs}
    await publish_and_ack(groups, _group(PromptJob.from_msgpack(by_id["p0:0"].data), True, 0).to_msgpack(),
                          prompts, [ids["p0:0"]])
    await publish_and_ack(dead, by_id["p1:1"].data, prompts, [ids["p1:1"]], extra={"reason": "x"})
    await client.xdel("prompts", ids["p2:2"], ids["p3:3"])
    assert await feeder.vanished("groups", "prompts:dead") == ["p2:2", "p3:3"]
    assert await feeder.reissue(["p2:2", "p3:3"]) == 2
    again = await prompts.read("w0", count=10)
    assert sorted(job_id_of(m.data) for m in again) == ["p2:2", "p3:3"]
    assert await feeder.vanished("groups", "prompts:dead") == []
    feeder.resolve("p0:0")
    await client.xdel("groups", *(e[0] for e in await client.xrange("groups")))  # committed: gone, resolved
    assert await feeder.vanished("groups", "prompts:dead") == []
    ledger.close()
    rep = check_file(tmp_path / "ledger.jsonl")
    assert rep.ok and rep.reissued == 2 and rep.admitted == 6
    await client.aclose()


class DeadLettering(ScriptedRollout):
    """A scripted rollout that dead-letters the jobs ``dead(job_id)`` names, with a reason."""

    def __init__(self, url: str, informative, dead, rng: random.Random) -> None:
        super().__init__(url, informative, rng)
        self.dead = dead
        self.dead_stream = RedisStream(self.client, "prompts:dead")

    async def _run(self) -> None:
        while True:
            for m in await self.prompts.read("w0", count=16, block_ms=50):
                job = PromptJob.from_msgpack(m.data)
                if self.dead(job.job_id):
                    await publish_and_ack(self.dead_stream, m.data, self.prompts, [m.id],
                                          extra={"reason": "delivered 6 times (max_deliveries=5)"})
                    continue
                group = _group(job, self.informative(job.job_id), job.policy_version)
                await self.groups.add(group.to_msgpack())
                await self.prompts.ack(m.id, delete=True)


async def test_dead_lettered_jobs_are_resolved_with_their_reason(redis_server, tmp_path):
    tcfg = TrainerConfig(batch_prompts=2, group_size=2, mini_batch_size=4, max_staleness=1, max_prompt_len=8,
                         max_response_len=8, micro_batch_max_tokens=32)
    jobs = _jobs(12, 2)

    def is_dead(job_id: str) -> bool:
        return int(job_id.split(":")[1]) % 4 == 1  # 3 of 12

    ledger = tmp_path / "ckpt" / "ledger.jsonl"
    trainer = LoopUnderTest(run_config(redis_server.url, tcfg, tmp_path, save_every=2), jobs)
    async with DeadLettering(redis_server.url, lambda _: True, is_dead, random.Random(0)):
        assert await asyncio.wait_for(trainer.train(), timeout=120) == 4  # 9 good jobs: 4 steps of 2
    trained = [job for step in sorted(trainer.trained) for job in trainer.trained[step]]
    assert sorted(trainer.trained) == [1, 2, 3, 4]
    assert not any(is_dead(j) for j in trained) and len(set(trained)) == 8
    client = connect(redis_server.url)
    try:  # Redis, the second witness: the 3 dead letters were acknowledged (and deleted)
        assert await stream_witness(client, "prompts:dead", "trainer") == StreamWitness(3, 0, 0)
        await check_ledger_against_redis(client, ledger, groups_stream="groups", dead_stream="prompts:dead",
                                         group="trainer")
    finally:
        await client.aclose()
    rep = check_file(ledger)
    assert rep.ok, rep.violations
    assert rep.dropped == {"dead_lettered": 3} and rep.outstanding == 1  # one kept group, short of a batch
    dropped = [line for line in ledger.read_text().splitlines() if '"dead_lettered"' in line]
    assert all("max_deliveries=5" in line for line in dropped)


async def test_the_trainer_client_rides_out_a_redis_restart(redis_server, tmp_path):
    tcfg = TrainerConfig(batch_prompts=2, group_size=2, mini_batch_size=4, max_staleness=1, max_prompt_len=8,
                         max_response_len=8, micro_batch_max_tokens=32)
    trainer = Trainer(run_config(redis_server.url, tcfg, tmp_path), jobs=_jobs(8, 2))
    await trainer._setup_streams()
    await trainer.feeder.top_up()
    redis_server.restart()  # every connection of the client is now dead
    depth = await trainer.feeder.stream.depth()  # reconnects, no error
    assert depth == 4
    await trainer.redis.aclose()
    trainer.ledger.close()
