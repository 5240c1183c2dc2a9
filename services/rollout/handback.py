"""Hand-back of a draining replica's prompt jobs, and their prompt pick-up by the other replicas.

A replica that drains (SIGTERM) hands every job it still holds back at once:
- ``hand_back`` moves each of its pending entries (XCLAIM ... JUSTID, in one MULTI/EXEC) to the
  well-known consumer ``HANDED_BACK`` with ``IDLE claim_idle_ms`` and ``RETRYCOUNT`` one below its
  delivery count, so the drain is not counted as a failed delivery toward ``max_deliveries``
  (the pick-up's XCLAIM counts it again);
- the entry stays where it is in the stream and in the pending list (at-least-once kept: it is
  acknowledged only with its group), and its job is taken *before* queued prompts;
- every replica with a free slot looks at ``HANDED_BACK``'s pending list (XPENDING, cheap) each
  time round its loop, before it reads new prompts, and takes the entries with XCLAIM
  ``min-idle-time claim_idle_ms``: the first claim resets the idle time, so a second replica's
  claim of the same entry takes nothing (one owner);
- a replica that does not look there (an older version) still re-claims them with its regular
  XAUTOCLAIM, at once, since their idle time is already ``claim_idle_ms``.

Why not re-XADD the job and XACK the old entry (MULTI/EXEC)? A replica blocked in XREADGROUP would
get it within a round trip, but behind every queued prompt (more staleness for a half-done
trajectory), with a new entry id and with its delivery count lost. Here an idle replica takes it
within one loop turn (``block_ms``, 1 s by default), a busy one at its next free slot, first.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from services.common.queue import RedisStream, StreamMessage, entry_id, stream_messages

HANDED_BACK = "handed-back"  # the consumer that holds handed-back entries until a replica takes them


@dataclass(frozen=True)
class Pickup:
    msg: StreamMessage
    waited_s: float  # from the hand-back to this pick-up (idle time beyond claim_idle_ms)


async def hand_back(stream: RedisStream, consumer: str, claim_idle_ms: int, ids: Collection[str],
                    page: int = 100) -> int:
    """Move those of ``ids`` still pending for ``consumer`` to ``HANDED_BACK``, ready to be taken;
    returns how many. The caller must no longer touch (heartbeat) or ack them."""
    client, group, wanted = stream.client, stream._need_group(), set(ids)
    moved, start = 0, "-"
    while wanted:
        rows = await client.xpending_range(stream.stream, group, min=start, max="+", count=page,
                                           consumername=consumer)
        if not rows:
            break
        start = "(" + entry_id(rows[-1]["message_id"])
        rows = [r for r in rows if entry_id(r["message_id"]) in wanted]
        if not rows:
            continue
        async with client.pipeline(transaction=True) as pipe:
            for row in rows:
                pipe.xclaim(stream.stream, group, HANDED_BACK, 0, [row["message_id"]], idle=claim_idle_ms,
                            retrycount=max(int(row["times_delivered"]) - 1, 0), justid=True)
            await pipe.execute()
        moved += len(rows)
        wanted -= {entry_id(r["message_id"]) for r in rows}
    return moved


async def take_handed_back(stream: RedisStream, consumer: str, claim_idle_ms: int,
                           count: int) -> list[Pickup]:
    """Up to ``count`` handed-back entries, now ``consumer``'s (each taken by one replica only)."""
    client, group = stream.client, stream._need_group()
    rows = await client.xpending_range(stream.stream, group, min="-", max="+", count=count,
                                       consumername=HANDED_BACK)
    if not rows:
        return []
    idle = {entry_id(r["message_id"]): int(r["time_since_delivered"]) for r in rows}
    deliveries = {entry_id(r["message_id"]): int(r["times_delivered"]) + 1 for r in rows}  # + this claim
    entries = await client.xclaim(stream.stream, group, consumer, claim_idle_ms, list(idle))
    return [Pickup(StreamMessage(m.id, m.data, deliveries[m.id]),
                   max(idle[m.id] - claim_idle_ms, 0) / 1000) for m in stream_messages(entries or [])]
