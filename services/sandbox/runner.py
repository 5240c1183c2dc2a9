"""One sandboxed run, supervised from the zygote's event loop (one fork per run).

Process tree of a run::

    zygote  (root; warm heap; serves many runs at once)  enforces the wall limit, reads output,
      │                                                   fetches the requested files
      ├── init  (pid 1 of the run's pid namespace)       libc's ``sleep`` in a child sharing the
      │                                                   zygote's memory: holds the namespace
      └── run   (pid 2; see ``run_process``)              enters its network/mount/ipc namespaces,
                                                          mounts its /proc and private tmpfs, drops
                                                          to the run's uid, installs the syscall
                                                          filter and executes the model's code

Invariants:
- the run has no network (an empty network namespace: not even loopback), sees only its
  own processes (fresh /proc), sees only the zygote's minimal root (``rootfs``) and can
  write nowhere but its private tmpfs, runs as an unprivileged uid no other concurrent run
  shares, with no_new_privs, an empty capability bounding set and the syscall filter, and
  inherits no descriptor but stdin/stdout/stderr;
- the run is not pid 1, so a signal it sends itself acts as on any process; its exit status
  (or the signal that ended it) is its own, read by ``waitpid`` here;
- when the run process ends, or at the wall limit, init is killed and with it, by the kernel,
  every process the run left behind; the run's mount namespace (and so its tmpfs) is held
  by a descriptor until its files are fetched;
- the zygote is back in its own mount and pid namespaces before it does anything else, and
  never needs ``CAP_KILL`` or ``CAP_DAC_OVERRIDE``: it signals only init (root), and reads a
  run's files with the run's file-system uid;
- output is captured up to the cap (head and tail kept), the rest counted, never buffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import posixpath
import signal
import stat
import time

from services.sandbox import linux, run_process
from services.sandbox.capture import CappedBuffer
from services.sandbox.cgroups import SlotCgroup, write_limits
from services.sandbox.phases import PhaseBoard, thread_cpu
from services.sandbox.protocol import RunOutcome, RunSpec

SLOT_NETNS: dict[int, int] = {}  # slot -> fd of its empty network namespace (see create_slot_netns)
HEAD = next((p for p in ("/usr/bin/head", "/bin/head") if os.access(p, os.X_OK)), "")
BOARD = PhaseBoard(1)  # replaced by the zygote: one row per slot it may serve
_STACKS = linux.SleeperStacks()  # one init stack per slot (a slot's init is reaped before its next run)
_KILL_DRAIN_S = 2.0
_INIT_GRACE_S = 30  # init outlives the wall limit by this much even if its zygote vanished
_OWN_PIDNS: list[int] = []  # fd of the zygote's own pid namespace, to return to after each fork


def create_slot_netns(slots: list[int]) -> None:
    """One empty network namespace per slot, created once in the zygote.

    Creating and destroying a network namespace per run is the costliest namespace
    operation; a slot's runs never overlap and nothing of a run outlives it, so a run
    entering its slot's namespace is as isolated as one in a brand-new namespace.
    """
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        for slot in slots:
            linux.unshare(linux.CLONE_NEWNET)
            SLOT_NETNS[slot] = os.open("/proc/self/ns/net", os.O_RDONLY)
    finally:
        linux.setns(own, linux.CLONE_NEWNET)
        os.close(own)


def remember_own_pid_namespace() -> None:
    _OWN_PIDNS.append(os.open("/proc/self/ns/pid", os.O_RDONLY))


def _start(spec: RunSpec, cgroup: SlotCgroup | None, fds: run_process.RunFds,
           lifeline: int = -1) -> tuple[int, int, float, float]:
    """Create the run's pid namespace, its init and the run process.

    Returns (init, run pid, zygote CPU seconds for the init, for the fork). Synchronous on
    purpose: between ``unshare`` and the return to the zygote's own pid namespace nothing
    else may run (no other fork may land in this run's namespace). Init, pid 1, is a
    ``clone_sleeper`` (no copy of this heap, no exec: ~50 us here against ~750 us for
    spawning ``sleep``) that ends by itself ``_INIT_GRACE_S`` after the wall limit. With
    ``lifeline`` (the read end of a pipe only the zygote writes to), init is a ``head``
    reading it, which ends, and with it the namespace, when the zygote dies: for sessions,
    whose lifetime is too long to leave to a sleep.
    """
    linux.unshare(linux.CLONE_NEWPID)
    try:
        t0 = thread_cpu()
        if lifeline >= 0 and HEAD:
            init = os.posix_spawn(HEAD, ["head", "-c", "1"], {},
                                  file_actions=[(os.POSIX_SPAWN_DUP2, lifeline, 0)])
        else:
            init = linux.clone_sleeper(_STACKS.top(spec.slot), math.ceil(spec.timeout_s) + _INIT_GRACE_S)
        t1 = thread_cpu()
        BOARD.clear(spec.slot)
        try:
            pid = os.fork()
        except OSError:
            _kill_init(init)
            os.waitpid(init, 0)
            raise
        if pid == 0:
            run_process.run(spec, cgroup, SLOT_NETNS.get(spec.slot), fds, BOARD)  # never returns
        t2 = thread_cpu()
    finally:
        linux.setns(_OWN_PIDNS[0], linux.CLONE_NEWPID)
    return init, pid, t1 - t0, t2 - t1


async def execute(spec: RunSpec) -> RunOutcome:
    cgroup = SlotCgroup(spec.cgroup_limits, spec.cgroup_procs) if spec.cgroup_procs else None
    fds = run_process.RunFds.create()
    try:
        if cgroup is not None and cgroup.limits:  # sent only when this slot's limits change
            write_limits(cgroup, spec.cgroup_memory_bytes, spec.max_processes, spec.cpu_cores)
        start = time.monotonic()
        init, pid, init_s, fork_s = _start(spec, cgroup, fds)
    except BaseException:
        fds.close_all()
        raise
    fds.close_run_ends()
    tmp_dir = -1
    try:
        out, err = CappedBuffer(spec.max_output_bytes), CappedBuffer(spec.max_output_bytes)
        try:
            streams = {fds.out_r: out, fds.err_r: err}
            collector = _Collector(pid, init, start + spec.timeout_s, spec.stdin, streams, fds.in_w)
            fds.out_r = fds.err_r = fds.in_w = -1  # the collector closes them
            timed_out, ended = await collector.wait()
        except BaseException:  # never leave a run running, or unwaited, behind
            _kill_init(init)
            await _reaped(pid)
            await _reaped(init)
            raise
        _, wait_status, usage = os.wait4(pid, 0)  # has exited: the collector saw it
        await _reaped(init)
        phases = BOARD.split(spec.slot, fork_s, init_s, usage.ru_utime + usage.ru_stime)
        setup_error = _read_all(fds.st_r).decode(errors="replace")
        tmp_dir = run_process.receive_tmp(fds.tmp_rx)
        if setup_error:
            return RunOutcome(ok=False, error=f"sandbox setup failed: {setup_error}")
        return_code = None if timed_out else _decode_wait_status(wait_status)
        files, notes = ({}, {}) if timed_out or tmp_dir < 0 else _fetch(tmp_dir, spec)
        return RunOutcome(return_code=return_code, timed_out=timed_out,
                          execution_time=spec.timeout_s if timed_out else ended - start,
                          stdout=out.render(), stderr=err.render(), stdout_truncated=out.dropped,
                          stderr_truncated=err.dropped, files=files, fetch_notes=notes, phases=phases)
    finally:
        fds.close_all()
        if tmp_dir >= 0:
            os.close(tmp_dir)


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def _reaped(pid: int) -> None:
    """Wait for a child without blocking the loop (init's exit waits for its namespace to empty)."""
    pidfd = os.pidfd_open(pid)
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == 0:
            exited = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
            try:
                await exited
            finally:
                asyncio.get_running_loop().remove_reader(pidfd)
            os.waitpid(pid, 0)
    finally:
        os.close(pidfd)


def _decode_wait_status(status: int) -> int:
    """Exit code, or minus the signal that ended the run (as ``subprocess`` reports it)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _kill_init(init: int) -> None:
    """End the run's pid namespace: the kernel kills every process left in it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(init, signal.SIGKILL)


class _Collector:
    """Pumps stdin/stdout/stderr on the event loop until the run process has ended and every
    stream is closed (or ``_KILL_DRAIN_S`` after it ended). At the end of the run process,
    or at the deadline, init is killed, which ends every process still in the namespace."""

    def __init__(self, pid: int, init: int, deadline: float, stdin: bytes, streams: dict[int, CappedBuffer],
                 in_w: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.init = init
        self.streams = streams
        self.open = set(streams)
        self.in_w = in_w
        self.pending = memoryview(stdin)
        self.ended: float | None = None
        self.timed_out = False
        self.done = self.loop.create_future()
        self.pidfd = os.pidfd_open(pid)
        for fd in streams:
            os.set_blocking(fd, False)
            self.loop.add_reader(fd, self._read, fd)
        self.loop.add_reader(self.pidfd, self._exited)
        if self.pending:
            os.set_blocking(in_w, False)
            self.loop.add_writer(in_w, self._write)
        else:
            self._close_stdin()
        self.timer = self.loop.call_at(self._loop_time(deadline), self._deadline)

    def _loop_time(self, monotonic_deadline: float) -> float:
        return self.loop.time() + max(0.0, monotonic_deadline - time.monotonic())

    async def wait(self) -> tuple[bool, float]:
        try:
            await self.done
        finally:
            self._close_all()
        return self.timed_out, self.ended if self.ended is not None else time.monotonic()

    def _read(self, fd: int) -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if chunk:
            self.streams[fd].feed(chunk)
            return
        self.loop.remove_reader(fd)
        os.close(fd)
        self.open.discard(fd)
        self._maybe_done()

    def _write(self) -> None:
        try:
            n = os.write(self.in_w, self.pending[:65536])
            self.pending = self.pending[n:]
        except BlockingIOError:
            return
        except OSError:  # the run closed its stdin
            self.pending = self.pending[:0]
        if not self.pending:
            self.loop.remove_writer(self.in_w)
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self.in_w >= 0:
            os.close(self.in_w)
            self.in_w = -1

    def _exited(self) -> None:
        self.ended = time.monotonic()
        self.loop.remove_reader(self.pidfd)
        _kill_init(self.init)  # whatever the run left behind ends with it
        self.timer.cancel()
        self.timer = self.loop.call_later(_KILL_DRAIN_S, self._finish)
        self._maybe_done()

    def _deadline(self) -> None:
        self.timed_out = True
        _kill_init(self.init)  # the run process dies with the namespace: _exited follows

    def _maybe_done(self) -> None:
        if self.ended is not None and not self.open:
            self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def _close_all(self) -> None:
        self.timer.cancel()
        for fd in list(self.open):
            self.loop.remove_reader(fd)
            os.close(fd)
        self.open.clear()
        if self.in_w >= 0:
            self.loop.remove_writer(self.in_w)
            self._close_stdin()
        if self.ended is None:
            self.loop.remove_reader(self.pidfd)
        os.close(self.pidfd)


def _fetch(tmp_dir: int, spec: RunSpec) -> tuple[dict[str, bytes], dict[str, str]]:
    """Read the requested files from the run's tmpfs, one by one: (contents, why-not notes).

    ``tmp_dir`` is the run's ``/tmp`` (its tmpfs, kept by this descriptor after the run's
    mount namespace is gone). A relative path is relative to the working directory; an
    absolute one must lie in ``/tmp``. Every component is opened without following
    symlinks, below ``tmp_dir``, and must stay on the tmpfs; non-regular and too-large
    files are skipped. Runs after every process of the run is dead (nothing can swap a
    path under us), with the run's file-system uid (its files, its permissions).
    """
    files: dict[str, bytes] = {}
    notes: dict[str, str] = {}
    if not spec.fetch_files:
        return files, notes
    tmp_dev = os.fstat(tmp_dir).st_dev
    linux.set_fs_ids(spec.uid, spec.uid)
    try:
        for name in spec.fetch_files:
            why = _fetch_one(tmp_dir, tmp_dev, name, spec.max_fetch_file_bytes, files)
            if why:
                notes[name] = why
    finally:
        linux.set_fs_ids(0, 0)
    return files, notes


def _fetch_one(tmp_dir: int, tmp_dev: int, name: str, max_bytes: int, files: dict[str, bytes]) -> str:
    if not name or "\x00" in name:
        return "invalid path"
    path = posixpath.normpath(posixpath.join(run_process.WORKDIR, name))
    if not path.startswith("/tmp/"):
        return "outside the run's /tmp"
    *dirs, leaf = path[len("/tmp/"):].split("/")
    held: list[int] = []
    try:
        current = tmp_dir
        for part in dirs:
            current = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=current)
            held.append(current)
        fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=current)
    except FileNotFoundError:
        return "not found"
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return "a symbolic link or not a directory on the way (links are not followed)"
        return f"not readable: {exc.strerror}"
    finally:
        for fd_ in held:
            os.close(fd_)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_dev != tmp_dev:
            return "outside the run's /tmp"
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size > max_bytes:
            return f"larger than max_fetch_file_bytes ({max_bytes})"
        files[name] = fh.read(max_bytes)
    return ""
