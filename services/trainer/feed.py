"""The trainer's side of the Redis streams: feed prompt jobs, collect scored groups.

Invariants:
- ``PromptFeeder`` pushes a job only when ``StalenessManager.admit`` grants it; the dataset
  cursor advances exactly by the jobs pushed, and both are in the checkpoint state;
- ``GroupReader`` acknowledges a group only in ``commit()``. Call it once the steps that
  used the groups are durable (right after the checkpoint that contains them): a crash
  before that leaves the groups pending, they are delivered again to the restarted trainer
  (same consumer name: its pending list) and used by the model state that lacks them, so
  no acknowledged group is lost and none is applied twice. Committing after every step
  instead keeps Redis small but loses the steps since the last checkpoint on a crash;
- a batch that no step used is ``release``d: left pending and unseen, delivered again;
  ``commit()`` acknowledges everything read since the last one, so a batch read ahead of the
  step that will train it (``trainer.feed_overlap``) is ``release``d for a checkpoint's state and
  commit and ``hold``-ed again after: it is never acknowledged before it was trained;
- ``top_up`` and ``vanished`` never interleave (the overlapped feed tops up from two tasks): a job
  is pushed and counted outstanding before any snapshot looks for it;
- a group dropped as stale, malformed, by a filter (dynamic sampling) or as ``reward_timeout`` (a
  response graded with no reward under the reward service's ``timeout_policy=drop``: the whole
  group goes, so no response's advantage is computed against a baseline missing one) gives its admission slot
  back (``StalenessManager.release``) and its ``job_id`` is remembered as seen, so a second copy
  is a duplicate; a duplicate (same ``job_id``, at-least-once delivery) changes no state. Drops
  are counted by reason and acknowledged with the next ``commit()`` (like used groups): a crash
  before the checkpoint that holds the returned slots delivers them again and they are resolved
  again, so the admission state stays exact across a resume;
- ``PromptFeeder.outstanding`` holds the cursor of every admitted job not resolved yet (no group
  kept or dropped, not dead-lettered); it is in the checkpoint state. A job found nowhere in
  Redis (``vanished``: not in the prompts stream, the groups stream nor the dead letters, read in
  one MULTI/EXEC snapshot; a job moves between them atomically, so a live one is always in one)
  was lost with Redis (AOF everysec loses up to a second) and is ``reissue``d under its own id;
- ``DeadLetters`` resolves outstanding jobs that a rollout replica gave up on
  (``<prompts>:dead``), with the replica's reason, and gives their admission slots back;
- a group is judged (kept, dropped or a duplicate) only once its job is admitted in this
  trainer's state (``PromptFeeder.admitted``): a crashed predecessor admitted jobs beyond its last
  checkpoint, and the resumed trainer can read their groups (its own pending list, or the stream)
  before its admission reaches them. Such a group is ``parked``: held unjudged (pending in Redis,
  never acknowledged, not seen) until ``top_up`` admits its job, then judged like any other. So a
  job is resolved exactly once, after its admission (the ledger's order), its admission slot is
  freed by that resolution, and the group the resumed run's own push produces is a duplicate.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack

from services.common.group_wire import decode_group
from services.common.logging import get_logger
from services.common.packed_group import PackedGroup
from services.common.queue import RedisStream, StreamMessage
from services.common.schemas import PromptJob
from services.trainer.ledger import LedgerWriter
from services.trainer.staleness import StalenessManager

log = get_logger("trainer.feed")


class PromptFeeder:
    def __init__(
        self, stream: RedisStream, dataset: Sequence[PromptJob], manager: StalenessManager, *,
        epochs: int = 1, ledger: LedgerWriter | None = None,
    ) -> None:
        self.stream = stream
        self.dataset = dataset
        self.manager = manager
        self.epochs = epochs
        self.ledger = ledger
        self.cursor = 0  # jobs pushed so far, over all epochs
        self.outstanding: set[int] = set()  # cursors of admitted jobs not resolved yet
        self._lock = asyncio.Lock()  # top_up and vanished, one at a time (see the module docstring)

    @property
    def exhausted(self) -> bool:
        return self.cursor >= len(self.dataset) * self.epochs

    def job(self, cursor: int) -> PromptJob:
        """The job admitted at ``cursor`` (its id: ``<dataset job id>:<cursor>``)."""
        job = self.dataset[cursor % len(self.dataset)]
        return job.model_copy(update={"job_id": f"{job.job_id}:{cursor}",
                                      "policy_version": self.manager.version})

    @staticmethod
    def cursor_of(job_id: str) -> int | None:
        tail = job_id.rsplit(":", 1)[-1]
        return int(tail) if tail.isdigit() else None

    def resolve(self, job_id: str) -> bool:
        """Mark a job resolved (kept, dropped or dead-lettered); False when it was not outstanding."""
        cursor = self.cursor_of(job_id)
        if cursor is None or cursor not in self.outstanding:
            return False
        self.outstanding.discard(cursor)
        return True

    def unresolve(self, job_id: str) -> None:
        """A kept group given back unused (``GroupReader.release``): its job is outstanding again."""
        cursor = self.cursor_of(job_id)
        if cursor is not None and cursor < self.cursor:
            self.outstanding.add(cursor)

    def admitted(self, job_id: str) -> bool:
        """Whether this state admitted ``job_id`` (its cursor is below ``cursor``). A job id
        without a cursor counts as admitted: its group is judged as it comes (not one of ours)."""
        cursor = self.cursor_of(job_id)
        return cursor is None or cursor < self.cursor

    def is_outstanding(self, job_id: str) -> bool:
        cursor = self.cursor_of(job_id)
        return cursor is not None and cursor in self.outstanding

    async def top_up(self) -> int:
        """Push as many jobs as admission control allows; returns how many were pushed."""
        async with self._lock:
            left = len(self.dataset) * self.epochs - self.cursor
            granted = self.manager.admit(left)
            jobs = [self.job(self.cursor + i) for i in range(granted)]
            if self.ledger is not None:  # recorded before any of them can be trained on
                self.ledger.admit([j.job_id for j in jobs])
            for job in jobs:
                await self.stream.add(job.to_msgpack())
                self.outstanding.add(self.cursor)
                self.cursor += 1
            return granted

    async def vanished(self, groups_stream: str, dead_stream: str) -> list[str]:
        """Outstanding jobs found in none of the prompts, groups and dead-letter streams."""
        async with self._lock:  # no job pushed between the snapshot and the outstanding set read
            if not self.outstanding:
                return []
            client = self.stream.client
            async with client.pipeline(transaction=True) as pipe:  # one consistent snapshot
                pipe.xrange(self.stream.stream, "-", "+")
                pipe.xrange(groups_stream, "-", "+")
                pipe.xrange(dead_stream, "-", "+")
                streams = await pipe.execute()
            present: set[str] = set()
            for entries in streams:
                for _, fields in entries or []:
                    job_id = job_id_of(fields.get(b"d", b"")) if fields else None
                    if job_id is not None:
                        present.add(job_id)
            return [self.job(c).job_id for c in sorted(self.outstanding) if self.job(c).job_id not in present]

    async def reissue(self, job_ids: list[str]) -> int:
        """Push vanished jobs again under their own ids (their admission slots are still held)."""
        cursors = [c for j in job_ids if (c := self.cursor_of(j)) is not None and c in self.outstanding]
        if not cursors:
            return 0
        if self.ledger is not None:
            self.ledger.write("reissue", job_ids=[self.job(c).job_id for c in cursors])
        for c in cursors:
            await self.stream.add(self.job(c).to_msgpack())
        log.warning("re-issued %d prompt jobs that vanished from Redis", len(cursors),
                    extra={"job_ids": [self.job(c).job_id for c in cursors][:20]})
        return len(cursors)

    def state_dict(self) -> dict[str, object]:
        return {"cursor": self.cursor, "outstanding": sorted(self.outstanding), **self.manager.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.cursor = int(state["cursor"])  # type: ignore[call-overload]
        self.outstanding = {int(c) for c in state.get("outstanding", [])}  # type: ignore[union-attr]
        self.manager.load_state_dict(state)  # type: ignore[arg-type]


def job_id_of(raw: bytes) -> str | None:
    """The ``job_id`` of a msgpack'd job or group, without decoding the rest; None if unreadable."""
    try:
        data = msgpack.unpackb(raw, raw=False)
    except Exception:  # msgpack raises several unrelated types
        return None
    job_id = data.get("job_id") if isinstance(data, dict) else None
    return job_id if isinstance(job_id, str) else None


class DeadLetters:
    """The trainer's consumer of ``<prompts>:dead``: jobs the rollout fleet gave up on.

    Entries are acknowledged with the trainer's ``commit()`` (like groups): a crash before the
    checkpoint that holds their resolution delivers them again.
    """

    def __init__(self, stream: RedisStream, consumer: str) -> None:
        self.stream = stream
        self.consumer = consumer
        self._uncommitted: list[str] = []
        self._pending_after: str | None = "0"

    async def read(self) -> list[tuple[str | None, str]]:
        """New dead letters as (job id, reason); never blocks."""
        msgs: list[StreamMessage] = []
        if self._pending_after is not None:
            msgs = await self.stream.read_own_pending(self.consumer, count=100, after=self._pending_after)
            if msgs:
                self._pending_after = msgs[-1].id
            else:
                self._pending_after = None
        if not msgs:
            msgs = await self.stream.read(self.consumer, count=100)
        out: list[tuple[str | None, str]] = []
        if not msgs:
            return out
        reasons = await self._reasons([m.id for m in msgs])
        for m in msgs:
            self._uncommitted.append(m.id)
            out.append((job_id_of(m.data), reasons.get(m.id, "")))
        return out

    async def _reasons(self, ids: list[str]) -> dict[str, str]:
        async with self.stream.client.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.xrange(self.stream.stream, i, i)
            found = await pipe.execute()
        out = {}
        for i, entries in zip(ids, found, strict=True):
            if entries:
                raw = entries[0][1].get(b"reason", b"")
                out[i] = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return out

    async def commit(self) -> int:
        ids, self._uncommitted = self._uncommitted, []
        return await self.stream.ack(*ids, delete=True)


def group_version(group: PackedGroup) -> int:
    """The policy version a group counts as: its oldest generated token (or its admission)."""
    return group.min_version if group.min_version >= 0 else group.job_policy_version


@dataclass
class Batch:
    groups: list[PackedGroup]  # token arrays as numpy views (``packed_group``), checked at decode
    message_ids: list[str]
    dropped: Counter[str] = field(default_factory=Counter)
    staleness: list[int] = field(default_factory=list)
    dropped_ids: list[str] = field(default_factory=list)  # acknowledged with the next commit()
    drops: list[tuple[str, str]] = field(default_factory=list)  # (job id, reason) resolved by a drop
    duplicates: list[str] = field(default_factory=list)  # job ids of groups dropped as duplicates


class GroupReader:
    def __init__(
        self, stream: RedisStream, consumer: str, manager: StalenessManager, *, seen_capacity: int = 100_000,
        vocab_size: int | None = None, admitted: Callable[[str], bool] | None = None,
    ) -> None:
        """``vocab_size``: groups holding a token id >= it are dropped as malformed (None: not checked);
        ``admitted(job_id)``: whether the job is admitted yet (``PromptFeeder.admitted``); a group
        of a job that is not is parked until it is (None: every job counts as admitted)."""
        self.stream = stream
        self.admitted = admitted
        self._parked: list[tuple[str, StreamMessage]] = []  # (job id, entry), in arrival order
        self.vocab_size = vocab_size
        self.consumer = consumer
        self.manager = manager
        self._seen: set[str] = set()
        self._seen_order: deque[str] = deque()
        self._seen_capacity = seen_capacity
        self._uncommitted: list[str] = []
        self._pending_after: str | None = "0"  # paging cursor over our own pending list; None: done

    async def _next_messages(self, count: int, block_ms: int) -> list[StreamMessage]:
        if self._pending_after is not None:  # first what this consumer held but never committed
            own = await self.stream.read_own_pending(self.consumer, count=count, after=self._pending_after)
            if own:
                self._pending_after = own[-1].id
                return own
            self._pending_after = None
        return await self.stream.read(self.consumer, count=count, block_ms=block_ms)

    @property
    def parked(self) -> list[str]:
        """Job ids of the groups held until their job is admitted (see the module docstring)."""
        return [job_id for job_id, _ in self._parked]

    def _park(self, job_id: str | None, m: StreamMessage) -> bool:
        """Hold ``m`` if its job is not admitted yet; True when parked."""
        if job_id is None or self.admitted is None or self.admitted(job_id):
            return False
        log.info("group of a job not admitted yet (a crashed run's admission): held until it is",
                 extra={"entry": m.id, "job_id": job_id})
        self._parked.append((job_id, m))
        return True

    def _unparked(self, count: int) -> list[StreamMessage]:
        """Up to ``count`` parked entries whose job is admitted now, oldest first."""
        if not self._parked or self.admitted is None:
            return []
        out: list[StreamMessage] = []
        for entry in list(self._parked):
            if len(out) == count:
                break
            if self.admitted(entry[0]):
                self._parked.remove(entry)
                out.append(entry[1])
        return out

    def remember(self, job_id: str) -> None:
        """Count ``job_id`` as resolved (a dead letter): a group for it later is a duplicate."""
        self._remember(job_id)

    def _remember(self, job_id: str) -> None:
        self._seen.add(job_id)
        self._seen_order.append(job_id)
        while len(self._seen_order) > self._seen_capacity:
            self._seen.discard(self._seen_order.popleft())

    async def next_batch(
        self,
        size: int,
        *,
        keep: Callable[[PackedGroup], bool] | None = None,
        block_ms: int = 1000,
        max_wait_rounds: int | None = None,
    ) -> Batch:
        """Read until ``size`` usable groups are held (or ``max_wait_rounds`` empty reads)."""
        batch = Batch([], [])
        empty_rounds = 0
        while len(batch.groups) < size:
            wanted = size - len(batch.groups)
            messages = self._unparked(wanted) or await self._next_messages(wanted, block_ms)
            if not messages:
                empty_rounds += 1
                if max_wait_rounds is not None and empty_rounds >= max_wait_rounds:
                    break
                continue
            for m in messages:
                try:
                    group = decode_group(m.data, vocab_size=self.vocab_size)
                except ValueError as exc:
                    job_id = job_id_of(m.data)
                    if self._park(job_id, m):
                        continue
                    log.warning("dropping malformed group",
                                extra={"entry": m.id, "job_id": job_id, "error": str(exc)[:500]})
                    batch.dropped["malformed"] += 1
                    batch.dropped_ids.append(m.id)
                    if job_id is not None and job_id not in self._seen:  # its job can never be accepted now
                        self._remember(job_id)
                        self.manager.release(1)
                        batch.drops.append((job_id, "malformed"))
                    # without a readable job id the slot stays held: the job, if it was one, is
                    # found vanished once this entry is acknowledged, and re-issued
                    continue
                if self._park(group.job_id, m):
                    continue
                reason = None
                if group.job_id in self._seen:
                    reason = "duplicate"
                elif self.manager.is_stale(group_version(group)):
                    reason = "stale"
                elif any(t.reward is None and t.reward_reason == "timeout" for t in group.trajectories):
                    reason = "reward_timeout"  # timeout_policy=drop: no reward to train on
                elif keep is not None and not keep(group):
                    reason = "filtered"
                if reason is not None:
                    log.info(
                        "dropping group",
                        extra={
                            "job_id": group.job_id,
                            "reason": reason,
                            "group_version": group_version(group),
                        },
                    )
                    batch.dropped[reason] += 1
                    batch.dropped_ids.append(m.id)
                    if reason != "duplicate":  # its job is resolved: remember it, give the slot back
                        self._remember(group.job_id)
                        self.manager.release(1)
                        batch.drops.append((group.job_id, reason))
                    else:
                        batch.duplicates.append(group.job_id)
                    continue
                self._remember(group.job_id)
                batch.groups.append(group)
                batch.message_ids.append(m.id)
                batch.staleness.append(self.manager.staleness(group_version(group)))
        self._uncommitted.extend(batch.message_ids)
        self._uncommitted.extend(batch.dropped_ids)
        return batch

    def release(self, batch: Batch) -> None:
        """Give back a batch that no step used (a stop while it was being filled).

        Its groups stay pending for this consumer in Redis and are neither acknowledged nor
        remembered as seen, so the restarted trainer receives and uses them.
        """
        released = set(batch.message_ids)
        self._uncommitted = [i for i in self._uncommitted if i not in released]
        job_ids = {g.job_id for g in batch.groups}
        self._seen -= job_ids
        self._seen_order = deque(j for j in self._seen_order if j not in job_ids)

    def hold(self, batch: Batch) -> None:
        """Undo ``release`` of a batch that a step will still train (read ahead, released only for
        a checkpoint's state and commit): acknowledged with the next commit, remembered as seen."""
        self._uncommitted.extend(batch.message_ids)
        for g in batch.groups:
            self._remember(g.job_id)

    async def commit(self) -> int:
        """Acknowledge every group handed out since the last commit (see the module docstring);
        a batch read ahead of its step must be ``release``d first (and ``hold``-ed after)."""
        ids, self._uncommitted = self._uncommitted, []
        return await self.stream.ack(*ids, delete=True)

    def state_dict(self) -> dict[str, list[str]]:
        return {"seen": list(self._seen_order)}

    def load_state_dict(self, state: dict[str, list[str]]) -> None:
        self._seen.clear()
        self._seen_order.clear()
        for job_id in state.get("seen", []):
            self._remember(job_id)
