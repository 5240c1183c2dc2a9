"""The training ledger: what became of every prompt job the trainer admitted.

One JSON object per line in ``<checkpoint_dir>/ledger.jsonl`` (rank 0 writes it), appended and
fsync'd record by record, so it survives SIGKILL and restarts. Records (``t``):

- ``admit``      job ids pushed to the prompts stream (admission control granted them);
- ``trained``    the job ids of the groups step ``step`` trained on;
- ``drop``       one job resolved without training, with its ``reason``: ``stale``, ``filtered``
  (dynamic sampling), ``malformed`` or ``dead_lettered`` (the rollout gave up on it: ``detail``);
- ``duplicate``  a second group for a job already resolved (at-least-once delivery), ignored;
- ``reissue``    jobs found nowhere in Redis (lost with it) and pushed again under the same id;
- ``checkpoint`` written *before* checkpoint ``step`` is saved: the state at this record is the
  state that checkpoint holds;
- ``resume``     the trainer restarted from checkpoint ``step`` (0: from scratch): everything
  after that checkpoint's record is undone (and done again by the resumed run);
- ``end``        the run ended at ``step`` with ``outstanding`` jobs admitted and not resolved.

Invariant checked by :func:`check` (``retool trainer ledger``): replaying the records, with
every ``resume`` rolling back to its checkpoint, each admitted job ends at most once (trained in
one step, or dropped with a reason), none is trained or dropped without being admitted, steps
follow each other, and at an ``end`` the jobs neither trained nor dropped are exactly the ones
the trainer still counted in flight (none vanished silently).

A torn last line (a SIGKILL in the middle of a write) is cut off when the writer opens the file
and ignored by the reader; a torn line anywhere else is an error.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

LEDGER_FILE = "ledger.jsonl"
DropReason = Literal["stale", "filtered", "malformed", "dead_lettered", "reward_timeout"]


class Record(BaseModel):
    """One ledger line."""

    model_config = ConfigDict(extra="forbid")

    t: Literal["admit", "trained", "drop", "duplicate", "reissue", "checkpoint", "resume", "end"]
    step: int | None = Field(None, ge=0)
    job_ids: list[str] = Field(default_factory=list)
    job_id: str | None = None
    reason: DropReason | None = None
    detail: str | None = None
    outstanding: int | None = Field(None, ge=0)
    time: float | None = None


def ledger_path(checkpoint_dir: str | Path) -> Path:
    return Path(checkpoint_dir) / LEDGER_FILE


class LedgerWriter:
    """Appends records, one fsync'd line each (rank 0 only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(self.path)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, t: str, **fields: Any) -> None:
        rec = Record(t=t, time=round(time.time(), 3), **fields)  # type: ignore[arg-type]
        self._fh.write(rec.model_dump_json(exclude_none=True, exclude_defaults=True) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def admit(self, job_ids: list[str]) -> None:
        if job_ids:
            self.write("admit", job_ids=job_ids)

    def trained(self, step: int, job_ids: list[str]) -> None:
        self.write("trained", step=step, job_ids=job_ids)

    def drop(self, job_id: str, reason: DropReason, detail: str | None = None) -> None:
        self.write("drop", job_id=job_id, reason=reason, detail=detail[:500] if detail else None)

    def close(self) -> None:
        self._fh.close()


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line without its newline (a write cut by SIGKILL)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as fh:
        data = fh.read()
        if data.endswith(b"\n"):
            return
        fh.truncate(data.rfind(b"\n") + 1)
        fh.flush()
        os.fsync(fh.fileno())


def read_records(path: str | Path) -> tuple[list[Record], bool]:
    """The records and whether a torn last line was ignored; ValueError names a bad line."""
    lines = Path(path).read_bytes().split(b"\n")
    torn = lines[-1] != b""
    if not torn:
        lines = lines[:-1]
    out: list[Record] = []
    for i, raw in enumerate(lines, start=1):
        last = i == len(lines)
        try:
            out.append(Record.model_validate(json.loads(raw)))
        except (ValueError, ValidationError) as exc:
            if last and torn:
                return out, True
            raise ValueError(f"{path}: line {i} is not a ledger record: {str(exc)[:300]}") from None
    return out, False


@dataclass
class _State:
    admitted: set[str] = field(default_factory=set)
    trained: dict[str, int] = field(default_factory=dict)  # job id -> step
    dropped: dict[str, str] = field(default_factory=dict)  # job id -> reason
    step: int = 0


@dataclass
class LedgerReport:
    """What the replay found; ``violations`` empty means the invariant holds."""

    admitted: int = 0
    trained_groups: int = 0
    steps: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    outstanding: int = 0
    duplicates: int = 0
    reissued: int = 0
    resumes: list[int] = field(default_factory=list)
    steps_redone: int = 0
    groups_redone: int = 0
    ended: bool = False
    torn_tail: bool = False
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "admitted": self.admitted, "trained_groups": self.trained_groups,
            "steps": self.steps, "dropped": dict(self.dropped), "outstanding": self.outstanding,
            "duplicates": self.duplicates, "reissued": self.reissued, "resumes": self.resumes,
            "steps_redone": self.steps_redone, "groups_redone": self.groups_redone, "ended": self.ended,
            "torn_tail": self.torn_tail, "violations": self.violations,
        }


def check(records: Iterable[Record], *, torn_tail: bool = False, max_violations: int = 50) -> LedgerReport:
    """Replay ``records`` (see the module docstring for the invariant)."""
    rep = LedgerReport(torn_tail=torn_tail)
    st = _State()
    snapshots: dict[int, _State] = {0: _State()}

    def bad(msg: str) -> None:
        if len(rep.violations) < max_violations:
            rep.violations.append(msg)

    for i, r in enumerate(records, start=1):
        where = f"record {i} ({r.t})"
        if r.t == "admit":
            for j in r.job_ids:
                if j in st.admitted:
                    bad(f"{where}: job {j} admitted twice")
                st.admitted.add(j)
        elif r.t == "trained":
            if r.step != st.step + 1:
                bad(f"{where}: step {r.step} follows step {st.step}")
            st.step = r.step if r.step is not None else st.step + 1
            if len(set(r.job_ids)) != len(r.job_ids):
                bad(f"{where}: step {r.step} trained a group twice: {sorted(_repeated(r.job_ids))}")
            for j in r.job_ids:
                _resolve(st, j, where, bad)
                st.trained[j] = st.step
        elif r.t == "drop":
            if r.job_id is None or r.reason is None:
                bad(f"{where}: a drop needs job_id and reason")
                continue
            _resolve(st, r.job_id, where, bad)
            st.dropped[r.job_id] = r.reason
        elif r.t == "duplicate":
            rep.duplicates += 1  # of a resolved job, or of one held for the step being filled
        elif r.t == "reissue":
            rep.reissued += len(r.job_ids)
            for j in r.job_ids:
                if j not in st.admitted or j in st.trained or j in st.dropped:
                    bad(f"{where}: job {j} re-issued but it is not outstanding")
        elif r.t == "checkpoint":
            if r.step != st.step:
                bad(f"{where}: checkpoint of step {r.step} at ledger step {st.step}")
            snapshots[st.step] = copy.deepcopy(st)
        elif r.t == "resume":
            step = r.step or 0
            rep.resumes.append(step)
            if step not in snapshots:
                bad(f"{where}: resumed from step {step}, which has no checkpoint record")
                continue
            rep.steps_redone += max(st.step - step, 0)
            rep.groups_redone += sum(1 for s in st.trained.values() if s > step)
            st = copy.deepcopy(snapshots[step])
            # checkpoints after the one resumed from are gone with the steps they held
            snapshots = {s: v for s, v in snapshots.items() if s <= step}
        elif r.t == "end":
            rep.ended = True
            outstanding = len(st.admitted) - len(st.trained) - len(st.dropped)
            if r.step != st.step:
                bad(f"{where}: the run ended at step {r.step} but the ledger holds {st.step} steps")
            if r.outstanding is not None and outstanding != r.outstanding:
                bad(f"{where}: {outstanding} admitted jobs unresolved in the ledger, but the trainer "
                    f"counted {r.outstanding} in flight: jobs vanished without a record")
    rep.admitted = len(st.admitted)
    rep.trained_groups = len(st.trained)
    rep.steps = st.step
    rep.dropped = Counter(st.dropped.values())
    rep.outstanding = rep.admitted - rep.trained_groups - sum(rep.dropped.values())
    return rep


def _repeated(ids: list[str]) -> set[str]:
    return {j for j, n in Counter(ids).items() if n > 1}


def _resolve(st: _State, job_id: str, where: str, bad: Any) -> None:
    if job_id not in st.admitted:
        bad(f"{where}: job {job_id} resolved but never admitted")
    if job_id in st.trained:
        bad(f"{where}: job {job_id} already trained at step {st.trained[job_id]}")
    if job_id in st.dropped:
        bad(f"{where}: job {job_id} already dropped ({st.dropped[job_id]})")


def check_file(path: str | Path) -> LedgerReport:
    records, torn = read_records(path)
    return check(records, torn_tail=torn)


def iter_lines(path: str | Path) -> Iterator[str]:
    """Human-readable lines, one per record (``retool trainer ledger --print``)."""
    records, _ = read_records(path)
    for r in records:
        body = r.model_dump(exclude_none=True, exclude_defaults=True, exclude={"t", "time"})
        yield f"{r.time or 0:.3f} {r.t:<10} {json.dumps(body)}"
