"""The overlapped feed (``trainer.feed_overlap``): rank 0 reads step N+1's groups while step N's
update runs.

``Trainer.step_once`` starts a ``Prefetch`` of ``Trainer._collect`` (the very collect of the
sequential loop: read, decode, validate, dedupe, staleness, ledger accounting) on rank 0's event
loop right after it handed step N's batch out, then runs the update in a worker thread (the only
thread that issues collectives meanwhile; ranks > 0 simply wait in their next broadcast).

Invariants (the ``Trainer`` keeps them; this module only holds the task and its timings):
- the prefetched batch is the batch the sequential loop would take next, up to the order groups
  arrive in: ``StalenessManager.begin_update`` makes staleness be judged at the version the batch
  is trained at (after step N) and counts step N's batch as trained, so drops, the ``used_up`` end
  and the release floor are decided as after ``advance``; nothing is admitted during the update
  (as in the sequential loop) and the feeder tops up right after step N's ``advance``, where the
  sequential loop's next collect starts: the same jobs are admitted at the same versions. Where
  rollout timing changes the order groups arrive in, batches differ exactly as between two
  sequential runs: every group is still kept, dropped or a duplicate once (the ledger check);
- a prefetched batch is never acknowledged before a step trained it: a checkpoint waits for the
  prefetch, ``release``s its batch for the checkpoint's state and the commit, and holds it again
  after (``GroupReader.hold``); a restart from that checkpoint finds its groups pending in Redis and
  their jobs outstanding, so it trains them (at-least-once delivery; the ledger never saw them);
- its ``group_wait_s`` deadline runs only once the loop waits for the batch (``result``, which
  sets ``awaited``): the sequential collect starts only after the update, validation and checkpoint;
- a stop releases it like the partial batch of a stop while waiting (``Trainer._release``); a crash
  leaves it pending in Redis, delivered again to the restarted trainer (same consumer);
- ``cancel`` returns only once the task is done, and always returns: redis-py's asyncio client can
  lose a cancellation that lands at the wrong moment of a blocking read (redis/redis-py#2028; here
  about 1 cancel in 75 of a task looping on ``XREADGROUP BLOCK 50``), and a read-ahead that lost
  it would loop for ever (its ``group_wait_s`` deadline does not run until it is awaited), so the
  cancel is repeated until it takes (``cancel_and_wait``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
CANCEL_RETRY_S = 1.0  # how long a cancelled task gets to end before it is cancelled again


async def cancel_and_wait(task: asyncio.Task[Any], retry_s: float = CANCEL_RETRY_S) -> None:
    """Cancel ``task`` and wait until it is done, cancelling it again every ``retry_s`` while it
    runs on (a cancellation lost in redis-py's client: see the module docstring). Its outcome is
    retrieved and dropped."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at garbage collection


class Prefetch(Generic[T]):
    """One collect running as a task beside an update; ``timings`` says how much of it the update hid."""

    def __init__(self, collect: Callable[[], Awaitable[T]]) -> None:
        self.started = time.perf_counter()
        self.finished: float | None = None
        self.update_ended: float | None = None
        self.awaited = False  # the loop waits for the batch: from here on ``group_wait_s`` counts
        self.task: asyncio.Task[T] = asyncio.create_task(self._run(collect))

    async def _run(self, collect: Callable[[], Awaitable[T]]) -> T:
        try:
            return await collect()
        finally:
            self.finished = time.perf_counter()

    def end_update(self) -> None:
        """The update it overlaps is over (trained, pushed, recorded): from here on it is waited for."""
        if self.update_ended is None:
            self.update_ended = time.perf_counter()

    async def result(self) -> T:
        """The collect's outcome (awaiting a finished one again returns the same)."""
        self.awaited = True
        return await self.task

    def timings(self) -> dict[str, float]:
        """``perf/feed_overlap_seconds``: collect time hidden behind the update;
        ``perf/feed_wait_seconds``: collect time after the update ended (on the critical path)."""
        end = self.finished if self.finished is not None else time.perf_counter()
        update_end = self.update_ended if self.update_ended is not None else end
        return {"perf/feed_overlap_seconds": max(min(end, update_end) - self.started, 0.0),
                "perf/feed_wait_seconds": max(end - update_end, 0.0)}

    async def cancel(self) -> None:
        """A crash path: stop the collect (what it read stays pending in Redis, delivered again)."""
        await cancel_and_wait(self.task)
