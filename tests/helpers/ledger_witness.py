"""A second witness for the training ledger: what Redis itself shows of the groups stream.

The ledger (``services/trainer/ledger.py``) and the trainer's ``groups_log`` are both written
from the trainer's own bookkeeping, so they agree even when that bookkeeping is wrong. Redis
counts on its own: ``XINFO STREAM`` says how many entries were ever added and how many are left,
and ``XINFO GROUPS`` how many the trainer's consumer group holds unacknowledged. The trainer
acknowledges a group and deletes it (``GroupReader.commit``) only after the checkpoint of the
step that resolved it, so once a run ended with its last checkpoint:

    entries added - entries left  ==  groups the ledger says were trained, dropped
                                      (stale / filtered / malformed) or ignored as duplicates

counting, like the ledger's own replay, only what survived each ``resume`` (what a crash undid
was never acknowledged: Redis delivered it again, and the resumed run resolved it again).

Dead letters live in their own stream and are counted against ``dropped["dead_lettered"]``.

Where Redis itself was killed (the chaos run: AOF ``everysec`` loses up to a second of writes,
acknowledgements included, so a group can be resolved twice or an entry vanish after it was
trained) only the direction that matters survives: Redis never acknowledged more groups than the
ledger accounts for, i.e. no group left Redis without being trained, dropped or counted as a
duplicate (``check_nothing_unaccounted``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.queue import connect
from services.trainer.ledger import LedgerReport, check, read_records

STREAM_DROPS = ("stale", "filtered", "malformed")  # drops of a group read from the groups stream


@dataclass(frozen=True)
class StreamWitness:
    added: int  # entries ever added (XINFO STREAM entries-added)
    left: int  # entries still in the stream
    pending: int  # delivered to the consumer group, not acknowledged

    @property
    def acknowledged(self) -> int:
        """Entries acknowledged and deleted (the trainer deletes what it acknowledges)."""
        return self.added - self.left


def witness_of(stream_info: dict[str, Any], groups_info: list[dict[str, Any]], group: str) -> StreamWitness:
    """``XINFO STREAM`` and ``XINFO GROUPS`` replies (redis-py's or ``redis-cli --json``'s)."""
    groups = {(g["name"].decode() if isinstance(g["name"], bytes) else g["name"]): g for g in groups_info}
    pending = int(groups[group]["pending"]) if group in groups else 0
    return StreamWitness(int(stream_info["entries-added"]), int(stream_info["length"]), pending)


async def stream_witness(client: Any, stream: str, group: str) -> StreamWitness:
    """What Redis shows of ``stream`` and of its consumer group ``group`` (zeros if never created)."""
    if not await client.exists(stream):
        return StreamWitness(0, 0, 0)
    return witness_of(await client.xinfo_stream(stream), await client.xinfo_groups(stream), group)


def surviving_duplicates(ledger: Path) -> int:
    """``duplicate`` records that no ``resume`` undid (``LedgerReport.duplicates`` counts them all)."""
    records, _ = read_records(ledger)
    count, at_checkpoint = 0, {0: 0}
    for r in records:
        if r.t == "duplicate":
            count += 1
        elif r.t == "checkpoint" and r.step is not None:
            at_checkpoint[r.step] = count
        elif r.t == "resume":
            count = at_checkpoint.get(r.step or 0, 0)
            at_checkpoint = {s: n for s, n in at_checkpoint.items() if s <= (r.step or 0)}
    return count


def ledger_groups_resolved(report: LedgerReport, duplicates: int) -> int:
    """Groups read from the groups stream that the ledger says were resolved."""
    return report.trained_groups + sum(report.dropped.get(r, 0) for r in STREAM_DROPS) + duplicates


async def check_ledger_against_redis(client: Any, ledger: Path, *, groups_stream: str, dead_stream: str,
                                     group: str) -> StreamWitness:
    """Assert that Redis acknowledged exactly the groups (and dead letters) the ledger resolved."""
    groups = await stream_witness(client, groups_stream, group)
    check_ledger_against(ledger, groups, await stream_witness(client, dead_stream, group))
    return groups


async def check_trainer_ledger_against_redis(url: str, ledger: Path) -> StreamWitness:
    """``check_ledger_against_redis`` on the Redis at ``url``, with the trainer's default streams
    (``groups``, ``prompts:dead``) and consumer group (``trainer``)."""
    client = connect(url)
    try:
        return await check_ledger_against_redis(client, ledger, groups_stream="groups",
                                                dead_stream="prompts:dead", group="trainer")
    finally:
        await client.aclose()

def _resolved(ledger: Path) -> tuple[LedgerReport, int]:
    records, torn = read_records(ledger)
    report = check(records, torn_tail=torn)
    return report, ledger_groups_resolved(report, surviving_duplicates(ledger))


def check_nothing_unaccounted(ledger: Path, groups: StreamWitness) -> None:
    """Assert that Redis acknowledged no group the ledger does not account for."""
    report, resolved = _resolved(ledger)
    assert groups.acknowledged <= resolved, (
        f"Redis acknowledged {groups.acknowledged} groups ({groups}) but the ledger resolved only "
        f"{resolved} (trained {report.trained_groups}, dropped {dict(report.dropped)}): groups vanished")


def check_ledger_against(ledger: Path, groups: StreamWitness, dead: StreamWitness) -> None:
    """Assert that ``groups`` and ``dead`` (what Redis shows) acknowledged what the ledger resolved."""
    report, resolved = _resolved(ledger)
    assert groups.acknowledged == resolved, (
        f"Redis acknowledged {groups.acknowledged} groups ({groups}); the ledger resolved {resolved} "
        f"(trained {report.trained_groups}, dropped {dict(report.dropped)}, duplicates "
        f"{surviving_duplicates(ledger)} of {report.duplicates})")
    assert dead.acknowledged == report.dropped.get("dead_lettered", 0), (dead, dict(report.dropped))
