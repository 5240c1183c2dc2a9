"""Redis worker: prompt jobs in (consumer group), one scored group of ``n`` trajectories out.

At-least-once semantics:
- a job is acknowledged only in the same MULTI/EXEC transaction that XADDs its group to the
  groups stream (``publish_and_ack``), so an acknowledged job always has its group written;
- while a job runs, the worker touches it every ``heartbeat_ms``; a job whose replica crashed
  stops being touched and is re-claimed (XAUTOCLAIM) by any replica after ``claim_idle_ms``;
- a job that fails here (engine or reward error) is left pending and is retried after
  ``claim_idle_ms``; a job that cannot be decoded, is invalid for this replica (n, prompt length)
  or was delivered more than ``max_deliveries`` times goes to ``<prompts_stream>:dead`` and is acked;
- while the engine reports itself broken (``engine_error``, e.g. a dead vLLM engine core) no job is
  read or claimed: they stay in the stream for healthy replicas (and for this one once restarted);
- on a drain (``begin_drain``, SIGTERM: services/rollout/shutdown.py) it stops reading and
  claiming at once and sets ``agent.draining`` (samples stop at their next turn boundary, after
  their checkpoint, with ``SampleDrained``); on a drain or a shutdown, running jobs get ``drain_s``
  to finish (a drain is cut short by ``stop``); then the rest are cancelled, and every job the
  drain or shutdown interrupted (running, drained or read but not started) is handed back at once
  (services/rollout/handback.py: no ``claim_idle_ms`` wait, the drain not counted as a delivery);
  a job that failed stays pending here for its retry after ``claim_idle_ms``, as above; replicas
  take handed-back jobs before new prompts;
- a replica presumed dead that still finishes writes a second group for the same job: the
  trainer dedupes groups on ``job_id``;
- with ``checkpoints`` on, each sample's state is written at every turn boundary and a job that
  starts here continues its samples from their checkpoints (``agent/checkpoint.py``); the heartbeat
  also records each running sample's length (to count regenerated tokens), and the checkpoints are
  deleted in the transaction that publishes the group.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.logging import get_logger
from services.common.queue import RedisStream, StreamMessage, publish_and_ack
from services.common.schemas import Group, PromptJob, version_range
from services.rollout.agent.checkpoint import CheckpointObserver, JobCheckpoints, checkpoint_key
from services.rollout.agent.drain import SampleDrained
from services.rollout.agent.loop import AgentLoop
from services.rollout.config import RedisWorkerConfig
from services.rollout.engine.base import engine_error
from services.rollout.handback import hand_back, take_handed_back

log = get_logger("rollout.worker")


@dataclass
class WorkerStats:
    jobs_done: int = 0
    jobs_failed: int = 0
    jobs_dead: int = 0
    jobs_reclaimed: int = 0
    jobs_handed_back: int = 0  # given back on a drain or shutdown
    jobs_taken_over: int = 0  # handed back by another replica, taken here
    in_flight: int = 0


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RolloutWorker:
    def __init__(
        self,
        agent: AgentLoop,
        prompts: RedisStream,
        groups: RedisStream,
        cfg: RedisWorkerConfig,
        *,
        max_n: int = 1024,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.agent = agent
        self.prompts = prompts
        self.groups = groups
        self.cfg = cfg
        self.max_n = max_n
        self.max_prompt_tokens = max_prompt_tokens
        self.consumer = cfg.consumer or default_consumer_name()
        self.dead = RedisStream(prompts.client, f"{prompts.stream}:dead")
        self.stats = WorkerStats()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        obs = agent.observer
        self.checkpoint_observer = obs if isinstance(obs, CheckpointObserver) else CheckpointObserver()
        self._checkpoints: dict[str, JobCheckpoints] = {}  # job_id -> its checkpoints, while it runs
        self._checkpoint_lock = asyncio.Lock()  # a progress beat never lands after the publish's delete
        self.draining = asyncio.Event()
        self._interrupted: set[str] = set()  # entry ids to hand back: drained, or read but not started
        # seconds from a hand-back to its pick-up here, per taken-over job (the server's metrics)
        self.on_taken_over: Callable[[float], None] = lambda _waited_s: None
        self.on_handed_back: Callable[[int], None] = lambda _jobs: None

    def begin_drain(self) -> None:
        """Take no more jobs; samples stop at their next turn boundary; ``run`` then hands back."""
        self.draining.set()
        self.agent.draining.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set or a drain begins; running jobs then get ``drain_s``, the
        rest are cancelled, and every job still held is handed back."""
        await self.prompts.ensure_group()
        log.info("rollout worker started", extra={"consumer": self.consumer, "stream": self.prompts.stream})
        heartbeat = asyncio.create_task(self._heartbeat(stop))
        last_claim = 0.0
        try:
            for msg in await self.prompts.read_own_pending(self.consumer, count=self.cfg.concurrency):
                self._start(msg)
            while not stop.is_set() and not self.draining.is_set():
                free = self.cfg.concurrency - len(self._tasks)
                if free <= 0:
                    await asyncio.wait(
                        list(self._tasks.values()),
                        timeout=self.cfg.block_ms / 1000,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    continue
                if engine_error(self.agent.engine) is not None:  # take no job a broken engine would fail
                    await asyncio.sleep(self.cfg.block_ms / 1000)
                    continue
                msgs = await self._take_handed_back(free)
                now = time.monotonic()
                if not msgs and now - last_claim >= self.cfg.heartbeat_ms / 1000:
                    last_claim = now
                    msgs = await self.prompts.claim_stale(
                        self.consumer, min_idle_ms=self.cfg.claim_idle_ms, count=free
                    )
                    msgs = [m for m in msgs if m.id not in self._tasks]
                    self.stats.jobs_reclaimed += len(msgs)
                if not msgs:
                    msgs = await self.prompts.read(self.consumer, count=free, block_ms=self.cfg.block_ms)
                if self.draining.is_set():  # read as the drain began: handed back below
                    self._interrupted.update(m.id for m in msgs)
                    break
                for msg in msgs:
                    self._start(msg)
        finally:
            await self._let_running_finish(stop)
            self._interrupted.update(self._tasks)
            heartbeat.cancel()
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.gather(heartbeat, *self._tasks.values(), return_exceptions=True)
            await self._hand_back()
            await self._leave_group()

    async def _let_running_finish(self, stop: asyncio.Event) -> None:
        """Up to ``drain_s`` for running jobs (heartbeat still on); a drain is cut short by ``stop``."""
        if not self._tasks or self.cfg.drain_s <= 0:
            return
        if not (self.draining.is_set() and stop.is_set()):  # both: a second signal came, cut short
            running = list(self._tasks.values())
            waiters = [asyncio.ensure_future(asyncio.wait(running, timeout=self.cfg.drain_s))]
            if self.draining.is_set():  # a drain: the server's stop (a second signal) cuts it short
                waiters.append(asyncio.ensure_future(stop.wait()))
            _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
        if self._tasks and stop.is_set() and self.draining.is_set():
            log.warning("drain cut short", extra={"running": len(self._tasks)})

    async def _hand_back(self) -> None:
        """Give every job this consumer still holds back at once (services/rollout/handback.py)."""
        try:
            n = await hand_back(self.prompts, self.consumer, self.cfg.claim_idle_ms, self._interrupted)
        except Exception:  # they stay pending here and are re-claimed after claim_idle_ms
            log.error("hand-back failed; jobs wait claim_idle_ms", exc_info=True)
            return
        self.stats.jobs_handed_back += n
        self.on_handed_back(n)
        if n:
            log.info("jobs handed back", extra={"jobs": n, "consumer": self.consumer})

    async def _take_handed_back(self, free: int) -> list[StreamMessage]:
        try:
            taken = await take_handed_back(self.prompts, self.consumer, self.cfg.claim_idle_ms, free)
        except Exception:  # a Redis hiccup: the regular claim takes them later
            log.warning("could not take handed-back jobs", exc_info=True)
            return []
        self.stats.jobs_taken_over += len(taken)
        for p in taken:
            self.on_taken_over(p.waited_s)
        return [p.msg for p in taken]

    async def _leave_group(self) -> None:
        """Remove this consumer from the group, but only when it holds no pending job (else the
        jobs would be dropped from the pending list and lost; they stay for re-claiming)."""
        try:
            client, stream, group = self.prompts.client, self.prompts.stream, self.prompts.group
            mine = await client.xpending_range(
                stream, group, min="-", max="+", count=1, consumername=self.consumer
            )
            if not mine:
                await client.xgroup_delconsumer(stream, group, self.consumer)
        except Exception:  # best effort on the way out
            log.warning("could not leave the consumer group", exc_info=True)

    def _start(self, msg: StreamMessage) -> None:
        if msg.id in self._tasks:
            return
        task = asyncio.create_task(self._process(msg))
        self._tasks[msg.id] = task
        self.stats.in_flight = len(self._tasks)

        def _done(_: asyncio.Task[None], mid: str = msg.id) -> None:
            self._tasks.pop(mid, None)
            self.stats.in_flight = len(self._tasks)

        task.add_done_callback(_done)

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)
            ids = list(self._tasks)
            if ids:
                try:
                    await self.prompts.touch(self.consumer, ids)
                    await self._write_progress()
                except Exception:  # a Redis hiccup must not kill the worker; the next beat retries
                    log.warning("heartbeat failed", exc_info=True)

    async def _write_progress(self) -> None:
        """One HSET per running job: each running sample's response length (``p<i>``)."""
        async with self._checkpoint_lock:
            beats = [(c.key, c.ttl_s, f) for c in list(self._checkpoints.values())
                     if (f := c.progress_fields())]
            if not beats:
                return
            async with self.prompts.client.pipeline(transaction=False) as pipe:
                for key, ttl_s, fields in beats:
                    pipe.hset(key, mapping=fields)
                    pipe.expire(key, ttl_s)
                await pipe.execute()

    async def _dead_letter(self, msg: StreamMessage, reason: str) -> None:
        log.error(
            "prompt job sent to the dead-letter stream", extra={"entry": msg.id, "reason": reason[:500]}
        )
        await publish_and_ack(self.dead, msg.data, self.prompts, [msg.id], extra={"reason": reason[:2000]})
        self.stats.jobs_dead += 1

    def prompt_ids(self, job: PromptJob) -> list[int]:
        """The job's prompt token ids; ValueError when the job cannot run on this replica."""
        if job.n > self.max_n:
            raise ValueError(f"n={job.n} exceeds this replica's max_n={self.max_n}")
        if job.prompt_ids is not None:
            ids = list(job.prompt_ids)
        else:
            assert job.messages is not None
            try:
                ids = self.agent.build_prompt([m.model_dump(exclude_none=True) for m in job.messages])
            except Exception as exc:  # a chat template may reject a message sequence
                raise ValueError(f"chat template failed: {exc}") from None
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise ValueError(
                f"prompt has {len(ids)} tokens, above max_prompt_tokens={self.max_prompt_tokens}"
            )
        return ids

    async def _process(self, msg: StreamMessage) -> None:
        if msg.deliveries > self.cfg.max_deliveries:
            await self._dead_letter(
                msg, f"delivered {msg.deliveries} times (max_deliveries={self.cfg.max_deliveries})"
            )
            return
        try:
            job = PromptJob.from_msgpack(msg.data)
            prompt_ids = self.prompt_ids(job)
        except ValueError as exc:
            await self._dead_letter(msg, str(exc))
            return
        try:
            group = await self.rollout(job, prompt_ids)
            done_keys = [checkpoint_key(self.prompts.stream, job.job_id)] if self.cfg.checkpoints else None
            async with self._checkpoint_lock:
                await publish_and_ack(self.groups, group.to_msgpack(), self.prompts, [msg.id],
                                      maxlen=self.cfg.groups_maxlen, delete_keys=done_keys)
            self.stats.jobs_done += 1
            log.info(
                "group written",
                extra={"job_id": job.job_id, "n": job.n, "rewards": [t.reward for t in group.trajectories]},
            )
        except asyncio.CancelledError:
            raise
        except SampleDrained:  # stopped at a turn boundary: handed back when the drain ends
            self._interrupted.add(msg.id)
            log.info("prompt job drained", extra={"job_id": job.job_id})
        except Exception as exc:
            self.stats.jobs_failed += 1
            log.error(
                "prompt job failed; left pending for retry",
                extra={"job_id": job.job_id, "error": str(exc)},
                exc_info=True,
            )

    async def rollout(self, job: PromptJob, prompt_ids: list[int]) -> Group:
        ckpt = None
        if self.cfg.checkpoints:
            ckpt = JobCheckpoints(self.prompts.client, checkpoint_key(self.prompts.stream, job.job_id),
                                  ttl_s=self.cfg.checkpoint_ttl_s,
                                  max_staleness=self.cfg.checkpoint_max_staleness,
                                  observer=self.checkpoint_observer)
            await ckpt.load()
            self._checkpoints[job.job_id] = ckpt
        try:
            trajs = await self.agent.run_group(
                prompt_ids,
                job.n,
                sampling=job.sampling,
                max_turns=job.max_turns,
                ground_truth=job.ground_truth,
                data_source=job.data_source,
                request_id=job.job_id,
                checkpoints=ckpt,
            )
        finally:
            self._checkpoints.pop(job.job_id, None)
        lo, hi = version_range(trajs)
        return Group(
            job_id=job.job_id,
            prompt_ids=prompt_ids,
            trajectories=trajs,
            ground_truth=job.ground_truth,
            data_source=job.data_source,
            job_policy_version=job.policy_version,
            min_version=lo,
            max_version=hi,
            replica=self.consumer,
            meta=job.meta,
        )
