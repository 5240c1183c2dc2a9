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
- a group dropped as stale, malformed or by a filter (dynamic sampling) gives its admission slot
  back (``StalenessManager.release``) and its ``job_id`` is remembered as seen, so a second copy
  is a duplicate; a duplicate (same ``job_id``, at-least-once delivery) changes no state. Drops
  are counted by reason and acknowledged with the next ``commit()`` (like used groups): a crash
  before the checkpoint that holds the returned slots delivers them again and they are resolved
  again, so the admission state stays exact across a resume.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.logging import get_logger
from services.common.queue import RedisStream, StreamMessage
from services.common.schemas import Group, PromptJob
from services.trainer.staleness import StalenessManager

log = get_logger("trainer.feed")


class PromptFeeder:
    def __init__(
        self, stream: RedisStream, dataset: Sequence[PromptJob], manager: StalenessManager, *, epochs: int = 1
    ) -> None:
        self.stream = stream
        self.dataset = dataset
        self.manager = manager
        self.epochs = epochs
        self.cursor = 0  # jobs pushed so far, over all epochs

    @property
    def exhausted(self) -> bool:
        return self.cursor >= len(self.dataset) * self.epochs

    async def top_up(self) -> int:
        """Push as many jobs as admission control allows; returns how many were pushed."""
        left = len(self.dataset) * self.epochs - self.cursor
        granted = self.manager.admit(left)
        for _ in range(granted):
            job = self.dataset[self.cursor % len(self.dataset)]
            job = job.model_copy(
                update={"job_id": f"{job.job_id}:{self.cursor}", "policy_version": self.manager.version}
            )
            await self.stream.add(job.to_msgpack())
            self.cursor += 1
        return granted

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, **self.manager.state_dict()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor = int(state["cursor"])
        self.manager.load_state_dict(state)


def group_version(group: Group) -> int:
    """The policy version a group counts as: its oldest generated token (or its admission)."""
    return group.min_version if group.min_version >= 0 else group.job_policy_version


@dataclass
class Batch:
    groups: list[Group]
    message_ids: list[str]
    dropped: Counter[str] = field(default_factory=Counter)
    staleness: list[int] = field(default_factory=list)
    dropped_ids: list[str] = field(default_factory=list)  # acknowledged with the next commit()


class GroupReader:
    def __init__(
        self, stream: RedisStream, consumer: str, manager: StalenessManager, *, seen_capacity: int = 100_000
    ) -> None:
        self.stream = stream
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

    def _remember(self, job_id: str) -> None:
        self._seen.add(job_id)
        self._seen_order.append(job_id)
        while len(self._seen_order) > self._seen_capacity:
            self._seen.discard(self._seen_order.popleft())

    async def next_batch(
        self,
        size: int,
        *,
        keep: Callable[[Group], bool] | None = None,
        block_ms: int = 1000,
        max_wait_rounds: int | None = None,
    ) -> Batch:
        """Read until ``size`` usable groups are held (or ``max_wait_rounds`` empty reads)."""
        batch = Batch([], [])
        empty_rounds = 0
        while len(batch.groups) < size:
            messages = await self._next_messages(size - len(batch.groups), block_ms)
            if not messages:
                empty_rounds += 1
                if max_wait_rounds is not None and empty_rounds >= max_wait_rounds:
                    break
                continue
            for m in messages:
                try:
                    group = Group.from_msgpack(m.data)
                except ValueError as exc:
                    log.warning("dropping malformed group", extra={"entry": m.id, "error": str(exc)[:500]})
                    batch.dropped["malformed"] += 1
                    batch.dropped_ids.append(m.id)
                    self.manager.release(1)  # its job can never be accepted now
                    continue
                reason = None
                if group.job_id in self._seen:
                    reason = "duplicate"
                elif self.manager.is_stale(group_version(group)):
                    reason = "stale"
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

    async def commit(self) -> int:
        """Acknowledge every group handed out since the last commit (see the module docstring)."""
        ids, self._uncommitted = self._uncommitted, []
        return await self.stream.ack(*ids, delete=True)

    def state_dict(self) -> dict[str, list[str]]:
        return {"seen": list(self._seen_order)}

    def load_state_dict(self, state: dict[str, list[str]]) -> None:
        self._seen.clear()
        self._seen_order.clear()
        for job_id in state.get("seen", []):
            self._remember(job_id)
