"""Live sessions, held by the zygote: one long-lived sandboxed run per session that executes cells.

A session is started exactly as a stateless run (``runner._start``: its own pid namespace
held by a bare ``sleep``, then ``run_process`` with its own mount/ipc/uts/network
namespaces, cgroup, uid and limits), except that the run process serves cells
(``session_main``) over a socket pair instead of running one program. The zygote keeps
the stdout/stderr pipes, the cell socket and the descriptor of the session's ``/tmp``.

Invariants:
- each cell waits for its result at most its own time limit; past it the whole session is
  killed (its pid namespace ends, and with it every process it started) and the cell is
  answered ``TimeLimitExceeded``; a malformed result frame also ends the session;
- when the session process ends for any reason (cell limit, memory, ``os._exit``, a signal,
  close, lifetime) its namespace is killed, both processes are reaped, every descriptor
  (and so its tmpfs) is released, and ``ended`` says why, in words; the session never
  outlives its ``timeout_s`` (lifetime), nor its zygote: init reads a pipe only the zygote
  holds open, and ends (ending the namespace) when the zygote dies;
- a cell's output is what reached the pipes from the cell's start until its result (and
  what background processes of earlier cells wrote meanwhile), capped like a run's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import struct
import time
from typing import Any

import msgpack

from services.sandbox import run_process
from services.sandbox.capture import CappedBuffer
from services.sandbox.cgroups import SlotCgroup, read_text, write_limits
from services.sandbox.protocol import RunOutcome, RunSpec
from services.sandbox.runner import _fetch, _kill_init, _reaped, _start

MAX_RESULT_FRAME = 4 * 1024 * 1024
_SETUP_TIMEOUT_S = 30.0
_EXIT_GRACE_S = 5.0
SESSIONS: dict[str, LiveSession] = {}


def _oom_kills(spec: RunSpec) -> int:
    """The OOM-kill count of the session's memory cgroup (v2 ``memory.events``, v1 ``oom_control``)."""
    for procs in spec.cgroup_procs:
        folder = os.path.dirname(procs)
        for name in ("memory.events", "memory.oom_control"):
            with contextlib.suppress(OSError):
                for line in read_text(os.path.join(folder, name)).splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
    return 0


def _error_info(error: object) -> dict[str, Any] | None:
    """Jupyter's error fields from what the session sent (which the cell's code could forge)."""
    if not isinstance(error, dict):
        return None
    tb = error.get("traceback")
    return {"ename": str(error.get("ename", "")), "evalue": str(error.get("evalue", "")),
            "traceback": [str(line) for line in tb] if isinstance(tb, list) else []}


def _figures(raw: object) -> list[dict[str, str]]:
    """Display data of the cell's plots (which the cell's code could forge: strings only)."""
    if not isinstance(raw, list):
        return []
    return [{str(k): str(v) for k, v in item.items() if k in ("text/plain", "image/png")}
            for item in raw if isinstance(item, dict)]


class LiveSession:
    def __init__(self, spec: RunSpec, init: int, pid: int, fds: run_process.RunFds, tmp_dir: int,
                 lifeline: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.spec, self.init, self.pid, self.fds, self.tmp_dir = spec, init, pid, fds, tmp_dir
        self.lifeline = lifeline  # closing it ends init (see ``runner._start``)
        self.ended = ""
        self._kill_reason = ""
        self.return_code: int | None = None
        self.done = self.loop.create_future()
        self.busy = asyncio.Lock()
        self.out, self.err = CappedBuffer(spec.max_output_bytes), CappedBuffer(spec.max_output_bytes)
        self._oom_at_start = _oom_kills(spec)
        os.close(fds.in_w)  # a session reads no stdin: EOF at once
        fds.in_w = -1
        self._streams = {fds.out_r: "out", fds.err_r: "err"}  # by name: each cell gets new buffers
        for fd in self._streams:
            os.set_blocking(fd, False)
            self.loop.add_reader(fd, self._read, fd)
        self.pidfd = os.pidfd_open(pid)
        self.loop.add_reader(self.pidfd, self._exited)
        self._lifetime = self.loop.call_later(spec.timeout_s, self.kill, "it reached its lifetime limit "
                                              f"of {spec.timeout_s:g} s")
        self._ctl: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def connect(self) -> None:
        sock = socket.socket(fileno=self.fds.ctl_z)
        self.fds.ctl_z = -1
        self._ctl = await asyncio.open_unix_connection(sock=sock, limit=MAX_RESULT_FRAME + 8)

    # -- output --------------------------------------------------------------------------------
    def _read(self, fd: int) -> bool:
        """One chunk of ``fd`` into its buffer; False when nothing more is there for now (or ever)."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if chunk:
            (self.out if self._streams[fd] == "out" else self.err).feed(chunk)
            return True
        self.loop.remove_reader(fd)
        del self._streams[fd]
        return False

    def _drain(self) -> None:
        for fd in list(self._streams):
            while self._read(fd):
                pass

    # -- end -----------------------------------------------------------------------------------
    def kill(self, reason: str) -> None:
        """End the session (its whole pid namespace); ``ended`` will give ``reason``."""
        if self.done.done():  # init was reaped: its pid may belong to another process by now
            return
        if not self._kill_reason:
            self._kill_reason = reason
        _kill_init(self.init)

    def _exited(self) -> None:
        self.loop.remove_reader(self.pidfd)
        os.close(self.pidfd)
        self.pidfd = -1
        _, status = os.waitpid(self.pid, 0)
        _kill_init(self.init)  # whatever the session left running ends with it
        self._lifetime.cancel()
        self.return_code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self.ended = self._kill_reason or self._why(status)
        self.loop.create_task(self._release())

    def _why(self, status: int) -> str:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGKILL and _oom_kills(self.spec) > self._oom_at_start:
                return (f"it exceeded its memory limit of {self.spec.memory_mb} MB "
                        "(killed by the kernel's OOM killer)")
            return f"its interpreter was killed by {signal.Signals(sig).name}"
        return f"its interpreter exited with code {os.WEXITSTATUS(status)}"

    async def _release(self) -> None:
        await _reaped(self.init)
        self._drain()
        for fd in list(self._streams):
            self.loop.remove_reader(fd)
        self._streams.clear()
        if self._ctl is not None:
            self._ctl[1].close()
        self.fds.close_all()
        if self.tmp_dir >= 0:
            os.close(self.tmp_dir)  # the last hold on the session's tmpfs
            self.tmp_dir = -1
        if self.lifeline >= 0:
            os.close(self.lifeline)
            self.lifeline = -1
        if not self.done.done():
            self.done.set_result(None)

    # -- cells ---------------------------------------------------------------------------------
    async def cell(self, msg: dict[str, Any]) -> RunOutcome:
        async with self.busy:
            return await self._cell(msg)

    async def _cell(self, msg: dict[str, Any]) -> RunOutcome:
        if self.ended or self._ctl is None:
            return RunOutcome(session_ended=self.ended or "not started", ran=False)
        timeout_s = float(msg["timeout_s"])
        self._drain()  # what background processes wrote while idle belongs to this cell
        cap = self.spec.max_output_bytes
        self.out, self.err = CappedBuffer(cap), CappedBuffer(cap)
        reader, writer = self._ctl
        body = msgpack.packb({"code": msg["code"], "files": msg.get("files", {})}, use_bin_type=True)
        start = time.monotonic()
        timed_out, reply = False, None
        try:
            async with asyncio.timeout(timeout_s):
                writer.write(struct.pack(">I", len(body)) + body)
                await writer.drain()
                (length,) = struct.unpack(">I", await reader.readexactly(4))
                if length > MAX_RESULT_FRAME:
                    raise ValueError(f"result frame of {length} bytes")
                reply = msgpack.unpackb(await reader.readexactly(length), raw=False)
                if not isinstance(reply, dict) or not isinstance(reply.get("rc"), int):
                    raise ValueError("result frame is not a result")
        except TimeoutError:
            timed_out = True
            self.kill(f"a cell ran past its time limit of {timeout_s:g} s")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the interpreter ended: ``done`` tells why
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self.kill(f"its interpreter sent a malformed result ({exc})")
        elapsed = time.monotonic() - start
        if reply is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.done), _EXIT_GRACE_S)
            if not self.done.done():
                self.kill("its interpreter stopped answering")
                await self.done
        self._drain()
        files: dict[str, bytes] = {}
        notes: dict[str, str] = {}
        if reply is not None and msg.get("fetch_files") and self.tmp_dir >= 0:
            wanted = dataclasses.replace(self.spec, fetch_files=list(msg["fetch_files"]))
            files, notes = _fetch(self.tmp_dir, wanted)
        display = reply.get("display") if reply else None
        figures = _figures(reply.get("figures")) if reply else []
        error = _error_info(reply.get("error")) if reply else None
        return RunOutcome(
            return_code=None if timed_out else (int(reply["rc"]) if reply else self.return_code),
            timed_out=timed_out, execution_time=timeout_s if timed_out else elapsed,
            stdout=self.out.render(), stderr=self.err.render(), stdout_truncated=self.out.dropped,
            stderr_truncated=self.err.dropped, files=files, fetch_notes=notes,
            display=display if isinstance(display, str) else None, figures=figures,
            error_info=error, session_ended=self.ended)


async def open_session(sid: str, spec: RunSpec) -> RunOutcome:
    if sid in SESSIONS:
        return RunOutcome(ok=False, error=f"session {sid} exists")
    cgroup = SlotCgroup(spec.cgroup_limits, spec.cgroup_procs) if spec.cgroup_procs else None
    fds = run_process.RunFds.create(session=True)
    life_r, life_w = os.pipe()  # init lives while this write end is open: as long as the zygote
    try:
        if cgroup is not None and cgroup.limits:
            write_limits(cgroup, spec.cgroup_memory_bytes, spec.max_processes, spec.cpu_cores)
        init, pid, _, _ = _start(spec, cgroup, fds, lifeline=life_r)
    except BaseException:
        fds.close_all()
        os.close(life_w)
        raise
    finally:
        os.close(life_r)
    fds.close_run_ends()
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fds.st_r, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, _SETUP_TIMEOUT_S)
        setup_error = os.read(fds.st_r, 65536).decode(errors="replace")
    except TimeoutError:
        setup_error = "timed out"
    finally:
        loop.remove_reader(fds.st_r)
    tmp_dir = run_process.receive_tmp(fds.tmp_rx) if not setup_error else -1
    if setup_error:
        _kill_init(init)
        await _reaped(pid)
        await _reaped(init)
        fds.close_all()
        os.close(life_w)
        return RunOutcome(ok=False, error=f"sandbox setup failed: {setup_error}")
    session = LiveSession(spec, init, pid, fds, tmp_dir, life_w)
    await session.connect()
    SESSIONS[sid] = session
    return RunOutcome(pids=[init, pid])


async def run_cell(sid: str, msg: dict[str, Any]) -> RunOutcome:
    session = SESSIONS.get(sid)
    if session is None:
        return RunOutcome(session_ended="its sandbox worker no longer holds it (the worker restarted)",
                          ran=False)
    return await session.cell(msg)


async def close_session(sid: str) -> RunOutcome:
    session = SESSIONS.pop(sid, None)
    if session is None:
        return RunOutcome(session_ended="unknown")
    session.kill("it was closed")
    await session.done
    return RunOutcome(session_ended=session.ended)
