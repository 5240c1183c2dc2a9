"""The overlapped feed (``trainer.feed_overlap``, ``services/trainer/prefetch.py``) through the
trainer's own loop (``Trainer.train``, ``step_once``; only the FSDP step stubbed) and a real Redis.

- with the overlap on, the run trains exactly the batches the sequential loop trains (same jobs,
  same steps, same drops), and the ledger and Redis agree;
- a SIGTERM while the next batch is read ahead (complete, or still short of groups) releases it:
  the stop's checkpoint does not acknowledge it, and the restarted trainer trains it next;
- a checkpoint's commit never acknowledges a batch read ahead: its groups stay pending in Redis,
  and a crash right after that checkpoint loses none of them and trains none twice;
- a resumed trainer that reads groups of jobs its crashed predecessor admitted after the last
  checkpoint, before its own admission reaches them, judges each once, after admitting it: none is
  dropped or trained unadmitted, no admission slot is freed twice or never (the "admitted jobs never
  came back" stall), none stays outstanding.

The stub update runs in the loop's worker thread; where a test needs the batch read ahead before
the update ends it waits for that (a condition with a deadline), so what is checked never depends
on timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from services.common.queue import connect
from services.common.schemas import PromptJob
from services.trainer.config import TrainerConfig
from services.trainer.feed import job_id_of
from services.trainer.ledger import check_file, ledger_path
from services.trainer.loop import Collected, RunConfig
from tests.helpers.ledger_witness import check_trainer_ledger_against_redis
from tests.integration.test_trainer_admission import (
    Crash,
    LoopUnderTest,
    ScriptedRollout,
    _group,
    _jobs,
    run_config,
)

pytestmark = pytest.mark.integration


def _tcfg(**kw: object) -> TrainerConfig:
    base: dict[str, object] = dict(batch_prompts=2, group_size=2, mini_batch_size=2, max_staleness=1,
                                   max_prompt_len=8, max_response_len=8, micro_batch_max_tokens=32,
                                   feed_overlap=True)
    return TrainerConfig(**{**base, **kw})


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """In the update thread: block until ``cond()`` (a deadline, never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class OverlapLoop(LoopUnderTest):
    """``LoopUnderTest`` whose stub update calls ``during_update(self, step)`` in the worker thread,
    and which can crash right after a checkpoint's commit (``crash_at_checkpoint``). After every
    checkpoint taken with a batch read ahead it notes that batch's job ids and checks, in Redis,
    that its groups are still pending (never acknowledged)."""

    def __init__(self, cfg: RunConfig, jobs: list[PromptJob], trained: dict[int, list[str]], *,
                 during_update: Callable[[OverlapLoop, int], None] | None = None,
                 crash_at_checkpoint: set[int] | None = None) -> None:
        super().__init__(cfg, jobs, trained=trained)
        self.during_update = during_update
        self.crash_at_checkpoint = crash_at_checkpoint if crash_at_checkpoint is not None else set()
        self.ahead_at_checkpoint: dict[int, list[str]] = {}

    def _train(self, rollouts, step: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
        out = super()._train(rollouts, step)
        if self.during_update is not None:
            self.during_update(self, step + 1)
        return out

    def prefetched(self) -> Collected | None:
        """The batch read ahead, once complete (read from the update thread: a finished task)."""
        if self._prefetch is None or not self._prefetch.task.done():
            return None
        got = self._prefetch.task.result()
        return got if isinstance(got, Collected) else None

    async def _checkpoint(self, step: int) -> None:
        await super()._checkpoint(step)
        held = await self._prefetched()
        if held is not None:
            self.ahead_at_checkpoint[step] = [g.job_id for g in held.groups]
            pending = {p["message_id"].decode() for p in
                       await self.redis.xpending_range("groups", "trainer", "-", "+", 1000)}
            assert set(held.message_ids) <= pending, "a checkpoint acknowledged a batch read ahead"
        if step in self.crash_at_checkpoint:
            self.crash_at_checkpoint.discard(step)
            raise Crash(step)


def _prefetch_complete(loop: OverlapLoop, step: int) -> None:
    if loop._prefetch is not None:
        wait_until(lambda: loop.prefetched() is not None, f"the batch after step {step} read ahead")


async def _train(trainer: OverlapLoop) -> int | None:
    """One trainer's run; None when it crashed (what a SIGKILL leaves)."""
    try:
        return await asyncio.wait_for(trainer.train(), timeout=120)
    except Crash:
        await trainer.die()
        return None


async def _check_ledger(url: str, cfg: RunConfig, trained: dict[int, list[str]], steps: int) -> list[str]:
    """The ledger's invariant and Redis's witness; returns the job ids trained, step by step."""
    ids = [job for s in range(1, steps + 1) for job in trained[s]]
    assert len(ids) == len(set(ids)), "a job trained twice"
    report = check_file(ledger_path(cfg.trainer.checkpoint_dir))
    assert report.ok, report.violations
    assert report.steps == steps and report.trained_groups == len(ids)
    await check_trainer_ledger_against_redis(url, ledger_path(cfg.trainer.checkpoint_dir))
    return ids


async def _pending_job_ids(url: str) -> list[str]:
    client = connect(url)
    try:
        pending = await client.xpending_range("groups", "trainer", "-", "+", 1000)
        entries = [(await client.xrange("groups", p["message_id"], p["message_id"]))[0] for p in pending]
        return sorted(job_id_of(fields[b"d"]) or "" for _, fields in entries)
    finally:
        await client.aclose()


class LaggingRollout(ScriptedRollout):
    """Every fifth job's group claims tokens one policy version older than its admission (a
    replica that lagged a push): stale at the version its batch trains at when ``max_staleness`` is
    1, kept if it were judged at the version of the update it is read during."""

    async def _publish(self, job: PromptJob, delay: float) -> None:
        lag = 1 if int(job.job_id.split(":")[1]) % 5 == 0 else 0
        group = _group(job, self.informative(job.job_id), max(job.policy_version - lag, 0))
        await self.groups.add(group.to_msgpack())


@pytest.mark.parametrize(("max_staleness", "batch_prompts", "save_every"), [(0, 2, 2), (1, 3, 1), (2, 2, 3)])
async def test_overlap_trains_exactly_the_batches_of_the_sequential_loop(
        redis_server, tmp_path, max_staleness, batch_prompts, save_every):
    jobs = _jobs(30, 2)

    def informative(job_id: str) -> bool:  # dynamic sampling drops one job in four
        return int(job_id.split(":")[1]) % 4 != 3

    def update(loop: OverlapLoop, step: int) -> None:  # a stand-in for forward/backward: the feed runs
        time.sleep(0.05)

    runs: dict[bool, tuple[list[str], dict[str, int], list[dict]]] = {}
    for overlap in (False, True):
        client = connect(redis_server.url)
        await client.flushdb()
        await client.aclose()
        tmp = tmp_path / f"overlap={overlap}"
        cfg = run_config(redis_server.url, _tcfg(batch_prompts=batch_prompts, max_staleness=max_staleness,
                                                 feed_overlap=overlap), tmp, save_every=save_every)
        trained: dict[int, list[str]] = {}
        async with LaggingRollout(redis_server.url, informative, random.Random(0)):
            steps = await _train(OverlapLoop(cfg, jobs, trained, during_update=update))
        assert steps is not None
        ids = await _check_ledger(redis_server.url, cfg, trained, steps)
        metrics = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
        runs[overlap] = ids, check_file(ledger_path(cfg.trainer.checkpoint_dir)).dropped, metrics
    (seq_ids, seq_drops, seq_metrics), (ids, drops, metrics) = runs[False], runs[True]
    assert ids == seq_ids and drops == seq_drops
    assert drops["stale"] > 0 and drops["filtered"] > 0  # both judged in the batches read ahead
    assert all(m["perf/feed_overlap_seconds"] == 0.0 for m in seq_metrics)
    assert all("perf/feed_wait_seconds" in m for m in metrics + seq_metrics)
    assert sum(m["perf/feed_overlap_seconds"] for m in metrics[1:]) > 0.0  # steps 2.. were read ahead


class GatedRollout(ScriptedRollout):
    """Holds the groups of jobs from cursor ``hold_from`` on until ``gate`` is set."""

    def __init__(self, url: str, hold_from: int) -> None:
        super().__init__(url, lambda _: True, random.Random(0))
        self.hold_from = hold_from
        self.gate = asyncio.Event()

    async def _publish(self, job: PromptJob, delay: float) -> None:
        if int(job.job_id.split(":")[1]) >= self.hold_from:
            await self.gate.wait()
        await super()._publish(job, delay)


@pytest.mark.parametrize("read_ahead", ["complete", "partial"])
async def test_a_sigterm_during_the_overlapped_read_releases_the_batch_for_the_restarted_trainer(
        redis_server, tmp_path, read_ahead):
    """Steps 1 and 2 train jobs 0-3; during step 2's update the batch of step 3 is read ahead
    (jobs 4 and 5, or only job 4 while job 5's group is held back), then SIGTERM."""
    cfg = run_config(redis_server.url, _tcfg(), tmp_path, save_every=10)
    jobs = _jobs(8, 2)
    trained: dict[int, list[str]] = {}

    def update(loop: OverlapLoop, step: int) -> None:
        if step == 2:
            if read_ahead == "complete":
                _prefetch_complete(loop, step)
            else:
                wait_until(lambda: "p4:4" in loop.reader._seen, "job 4's group read ahead")
            os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler: a stop request
            wait_until(lambda: loop.stop_requested, "the SIGTERM handled")

    rollout = GatedRollout(redis_server.url, hold_from=5 if read_ahead == "partial" else 8)
    async with rollout:
        first = OverlapLoop(cfg, jobs, trained, during_update=update)
        assert await _train(first) == 2
        ahead = ["p4:4", "p5:5"] if read_ahead == "complete" else ["p4:4"]
        assert await _pending_job_ids(redis_server.url) == ahead  # released: neither acknowledged nor lost
        assert first.ahead_at_checkpoint == {}  # the stop's checkpoint was taken with nothing held
        rollout.gate.set()
        assert await _train(OverlapLoop(cfg, jobs, trained)) == 4
    assert set(ahead) <= set(trained[3])  # trained next, not dropped as duplicates
    assert sorted(await _check_ledger(redis_server.url, cfg, trained, 4)) == sorted(
        f"p{i}:{i}" for i in range(8))


async def test_a_checkpoint_never_acknowledges_the_batch_read_ahead(redis_server, tmp_path):
    """Every step checkpoints while the next batch is already read; the process dies right after
    step 2's checkpoint and commit: the batch read ahead then is trained by the restarted trainer."""
    cfg = run_config(redis_server.url, _tcfg(), tmp_path, save_every=1)
    jobs = _jobs(10, 2)
    trained: dict[int, list[str]] = {}
    async with ScriptedRollout(redis_server.url, lambda _: True, random.Random(0)):
        first = OverlapLoop(cfg, jobs, trained, during_update=_prefetch_complete, crash_at_checkpoint={2})
        assert await _train(first) is None
        assert sorted(first.ahead_at_checkpoint) == [1, 2]  # both checkpoints had a batch read ahead
        assert await _pending_job_ids(redis_server.url) == sorted(first.ahead_at_checkpoint[2])
        second = OverlapLoop(cfg, jobs, trained, during_update=_prefetch_complete)
        assert await _train(second) == 5
    assert trained[3] == first.ahead_at_checkpoint[2]
    assert sorted(second.ahead_at_checkpoint) == [3, 4]  # the last step reads nothing ahead
    assert sorted(await _check_ledger(redis_server.url, cfg, trained, 5)) == sorted(
        f"p{i}:{i}" for i in range(10))


def _times_delivered(url: str, job_id: str) -> int:
    """How often Redis delivered the pending group of ``job_id`` to the trainer (0: none pending).
    A plain client: called from the update thread."""
    client = redis.Redis.from_url(url)
    try:
        for p in client.xpending_range("groups", "trainer", "-", "+", 1000):
            entry = client.xrange("groups", p["message_id"], p["message_id"])
            if entry and job_id_of(entry[0][1][b"d"]) == job_id:
                return int(p["times_delivered"])
        return 0
    finally:
        client.close()


async def test_groups_read_before_the_resumed_trainer_admits_their_jobs_wait_for_the_admission(
        redis_server, tmp_path):
    """Jobs 3 and 4 are filtered (dynamic sampling). The first trainer reads jobs 2 and 3 ahead
    during step 1's update, admits jobs 4-6 after it (job 3's slot came back), drops job 4, admits
    job 7 and reads job 5 into step 2's batch; it dies in step 2's update, before any checkpoint.
    The restarted trainer replays that from its pending list: during its step 1's update it reads
    2, 3, 4 and 5, and its state admits 4 and 5 only after that update. Each must be judged once,
    after its admission: before the fix job 4 was dropped unadmitted (a ledger violation, and a
    slot freed that it never held) and job 5 trained unadmitted and left outstanding for ever."""
    cfg = run_config(redis_server.url, _tcfg(), tmp_path, save_every=10)
    cfg = cfg.model_copy(update={"group_wait_s": 20.0})
    jobs = _jobs(8, 2)
    trained: dict[int, list[str]] = {}

    def informative(job_id: str) -> bool:
        return job_id not in ("p3:3", "p4:4")

    def crash_in_step_2(loop: OverlapLoop, step: int) -> None:
        if step == 2:
            raise Crash(step)

    def until_job_5_read_again(loop: OverlapLoop, step: int) -> None:
        if step == 1:  # the restarted trainer admits jobs 4 and 5 after this update
            wait_until(lambda: _times_delivered(redis_server.url, "p5:5") >= 2,
                       "job 5's pending group read again during step 1's update")

    async with ScriptedRollout(redis_server.url, informative, random.Random(0)):
        assert await _train(OverlapLoop(cfg, jobs, trained, during_update=crash_in_step_2)) is None
        assert trained[2] == ["p2:2", "p5:5"]  # jobs 4 and 5 admitted after step 1's update
        second = OverlapLoop(cfg, jobs, trained, during_update=until_job_5_read_again)
        steps = await _train(second)
    assert steps == 3  # six informative jobs: three batches, then the data is used up
    assert trained[2] == ["p2:2", "p5:5"]  # the same batch, job 5 judged once it was admitted
    ids = await _check_ledger(redis_server.url, cfg, trained, steps)
    assert sorted(ids) == [f"p{i}:{i}" for i in (0, 1, 2, 5, 6, 7)]
    report = check_file(ledger_path(cfg.trainer.checkpoint_dir))
    assert report.ended and report.dropped == {"filtered": 2} and report.outstanding == 0
    assert second.manager.in_flight(0) == 0 and second.feeder.outstanding == set()
    assert second.reader.parked == []  # every group held for its admission was judged


def test_the_overlapped_feed_is_the_default(tmp_path: Path):
    assert TrainerConfig().feed_overlap is True  # see the field's description
    assert TrainerConfig(feed_overlap=False).feed_overlap is False  # the sequential loop
