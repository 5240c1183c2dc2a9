"""The service's registry of live interpreter sessions: admission, idle expiry, and who holds what.

A session is a long-lived sandboxed run held by one zygote (``session_runner``). Session
``k`` has its own slot, after the run slots: index ``max_concurrency + k``, so its own uid
(``uid_base + index``), its own cgroup and (as no run slot shares it) a fresh network
namespace; no run and no other session uses them while it lives.

Invariants:
- at most ``max_sessions`` live at once; one more ``open`` raises ``SessionLimit`` (429);
- a session's cells run one at a time; a session idle longer than its TTL is closed by the
  reaper, and one open longer than ``session_max_lifetime_s`` ends (zygote-side timer);
- a session that ended (closed, expired, killed by its memory or time limit, or lost with
  its zygote) frees its slot only after its processes are gone; later calls on it raise
  ``SessionEnded`` with the reason in words (410), unknown ids ``SessionUnknown`` (404).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.logging import get_logger
from services.sandbox.cgroups import SlotCgroup
from services.sandbox.config import SandboxConfig
from services.sandbox.limits import clamp_cpu
from services.sandbox.protocol import RunOutcome, RunSpec
from services.sandbox.zygote_process import Zygote

log = get_logger("sandbox.sessions")
_OPEN_TIMEOUT_S = 30.0
_CLOSE_TIMEOUT_S = 20.0
_REAP_INTERVAL_S = 0.5
_ENDED_KEPT = 4096  # reasons remembered for ids that ended


class SessionLimit(Exception):
    """All ``max_sessions`` are live."""


class SessionUnknown(Exception):
    """No session has this id."""


class SessionEnded(Exception):
    """The session ended earlier; ``str()`` says why."""


@dataclass
class Session:
    id: str
    slot: int
    zygote: Zygote
    memory_mb: int
    ttl_s: float
    cgroup: SlotCgroup | None
    cpu_cores: float = 1.0
    opened: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    pids: list[int] = field(default_factory=list)  # host pids: [init, interpreter]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cells: int = 0


def reason_kind(reason: str) -> str:
    """A metric label for an end reason (the words come from ``session_runner`` and here)."""
    for needle, kind in (("lifetime", "lifetime"), ("time limit", "cell_timeout"), ("memory", "memory"),
                         ("idle", "expired"), ("closed", "closed"), ("worker", "worker_lost")):
        if needle in reason:
            return kind
    return "died"


class SessionRegistry:
    def __init__(self, cfg: SandboxConfig, zygotes: list[Zygote],
                 cgroup_for: Callable[[int], SlotCgroup | None]) -> None:
        """``zygotes``: those that may hold sessions; ``cgroup_for(index)``: a slot's cgroup or None."""
        self.cfg = cfg
        self.zygotes = zygotes
        self._cgroup_for = cgroup_for
        self._free = list(range(cfg.max_sessions))
        self.live: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self.on_end: Callable[[str], None] = lambda kind: None  # metrics hook: the reason's kind
        self._reaper: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(self.close(sid, "the service stopped") for sid in list(self.live)),
                             return_exceptions=True)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            with contextlib.suppress(Exception):
                await self.expire_idle()

    async def expire_idle(self) -> int:
        now = time.monotonic()
        idle = [s for s in self.live.values() if not s.lock.locked() and now - s.last_used > s.ttl_s]
        for s in idle:
            await self.close(s.id, f"it was idle longer than its TTL of {s.ttl_s:g} s")
        return len(idle)

    # -- open / close --------------------------------------------------------------------------
    async def open(self, ttl_s: float | None, memory_mb: int,
                   cpu_cores: float | None = None) -> tuple[Session, list[str]]:
        cfg, notes = self.cfg, []
        if cfg.max_sessions == 0:
            raise SessionLimit("sessions are off on this sandbox (max_sessions=0); use stateless /run_code")
        if not self._free:
            raise SessionLimit(f"sandbox has {len(self.live)} live sessions, the maximum (max_sessions="
                               f"{cfg.max_sessions}); close one with DELETE /sessions/{{id}} or wait "
                               f"for idle ones to expire")
        ttl = ttl_s if ttl_s is not None else cfg.session_idle_ttl_s
        if ttl > cfg.max_session_idle_ttl_s:
            notes.append(f"ttl_s {ttl:g} clamped to the maximum {cfg.max_session_idle_ttl_s:g}")
            ttl = cfg.max_session_idle_ttl_s
        memory = memory_mb if memory_mb > 0 else cfg.default_memory_mb
        if memory > cfg.max_memory_mb:
            notes.append(f"memory_limit_MB {memory} clamped to the maximum {cfg.max_memory_mb}")
            memory = cfg.max_memory_mb
        cores = clamp_cpu(cpu_cores, cfg, notes)
        slot = self._free.pop(0)
        index = cfg.max_concurrency + slot
        alive = [z for z in self.zygotes if z.alive] or self.zygotes
        zygote = alive[slot % len(alive)]
        session = Session(secrets.token_hex(16), slot, zygote, memory, ttl, self._cgroup_for(index), cores)
        try:
            outcome = await zygote.call({"op": "session_open", "id": session.id,
                                         "spec": self._spec(session, index).__dict__}, _OPEN_TIMEOUT_S)
        except BaseException:
            self._free.append(slot)
            raise
        if not outcome.ok:
            self._free.append(slot)
            raise RuntimeError(outcome.error)
        session.pids = list(outcome.pids)
        self.live[session.id] = session
        return session, notes

    def _spec(self, s: Session, index: int) -> RunSpec:
        cfg = self.cfg
        run_mb = s.memory_mb + cfg.workdir_size_mb + cfg.cgroup_slack_mb
        cg = s.cgroup
        return RunSpec(code="", session=True, timeout_s=cfg.session_max_lifetime_s, memory_mb=s.memory_mb,
                       stack_bytes=cfg.stack_mb_for(s.memory_mb) * 2**20, uid=cfg.uid_base + index,
                       slot=index, max_output_bytes=cfg.max_output_bytes, max_processes=cfg.max_processes,
                       workdir_size_mb=cfg.workdir_size_mb, max_fetch_file_bytes=cfg.max_fetch_file_bytes,
                       cgroup_limits=cg.limits if cg else {}, cgroup_procs=cg.procs if cg else [],
                       cgroup_memory_bytes=run_mb * 2**20, cpu_cores=s.cpu_cores)

    async def close(self, sid: str, reason: str = "it was closed") -> str:
        """End a live session (if still live); returns why it ended."""
        s = self.live.get(sid)
        if s is None:
            if sid in self._ended:
                return self._ended[sid]
            raise SessionUnknown(f"no session {sid!r}")
        ended = reason
        try:
            out = await s.zygote.call({"op": "session_close", "id": sid}, _CLOSE_TIMEOUT_S)
            if out.session_ended and out.session_ended not in ("unknown", "it was closed"):
                ended = out.session_ended  # it had already ended by itself
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            pass  # its zygote is gone, and the session with it
        self._forget(s, ended)
        return ended

    def _forget(self, s: Session, reason: str) -> None:
        if self.live.pop(s.id, None) is None:
            return
        self._free.append(s.slot)
        self._ended[s.id] = reason
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)
        self.on_end(reason_kind(reason))
        log.info("session ended", extra={"session": s.id, "reason": reason, "cells": s.cells})

    # -- cells ---------------------------------------------------------------------------------
    def get(self, sid: str) -> Session:
        s = self.live.get(sid)
        if s is not None:
            return s
        if sid in self._ended:
            raise SessionEnded(f"session {sid} has ended: {self._ended[sid]}; its state is lost, "
                               "open a new session")
        raise SessionUnknown(f"no session {sid!r} (never opened here, or ended long ago)")

    async def run_cell(self, sid: str, code: str, timeout_s: float, files: dict[str, bytes],
                       fetch_files: list[str]) -> RunOutcome:
        s = self.get(sid)
        async with s.lock:
            self.get(sid)  # it may have ended while this call waited for the previous cell
            s.cells += 1
            msg = {"op": "session_cell", "id": sid, "code": code, "timeout_s": timeout_s, "files": files,
                   "fetch_files": fetch_files}
            try:
                outcome = await s.zygote.call(msg, timeout_s + 5.0)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                await self.close(sid, f"its sandbox worker was lost ({type(exc).__name__})")
                raise SessionEnded(f"session {sid} has ended: {self._ended.get(sid)}") from None
            finally:
                s.last_used = time.monotonic()
            if outcome.session_ended:
                await self.close(sid, outcome.session_ended)
                if not outcome.ran:
                    raise SessionEnded(f"session {sid} has ended: {outcome.session_ended}")
            return outcome

    # -- observability -------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Memory charged to the live sessions: their cgroups' usage, else their interpreters' RSS."""
        return sum(_usage(s) for s in list(self.live.values()))


def _usage(s: Session) -> int:
    if s.cgroup is not None:
        for procs in s.cgroup.procs:
            folder = procs.rsplit("/", 1)[0]
            for name in ("memory.current", "memory.usage_in_bytes"):
                with contextlib.suppress(OSError, ValueError), open(f"{folder}/{name}") as fh:
                    return int(fh.read())
    if len(s.pids) > 1:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{s.pids[1]}/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    return 0
