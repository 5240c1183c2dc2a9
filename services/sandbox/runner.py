"""One sandboxed run, supervised by a process forked from a warm zygote.

Process tree of a run::

    runner  (root; fresh mount/net/ipc/uts namespaces)  enforces the wall limit, reads output,
      │                                                   fetches the requested files
      ├── init  (pid 1 of the run's pid namespace)       a bare ``sleep``: holds the namespace
      └── run   (pid 2; see ``run_process``)              mounts its private tmpfs, writes the
                                                          input files, drops to the run's uid
                                                          and executes the model's code

Invariants:
- the run has no network (a fresh, unconfigured network namespace: not even loopback),
  sees only its own processes (fresh /proc), cannot write anywhere but its private tmpfs
  (the zygote remounted every inherited mount read-only), runs as an unprivileged uid no
  other concurrent run shares, with no_new_privs, and inherits no descriptor but
  stdin/stdout/stderr;
- the run is not pid 1, so a signal it sends itself acts as on any process; its exit
  status (or the signal that ended it) is its own, read by ``waitpid`` here;
- when the run process ends, or at the wall limit, init is killed and with it, by the
  kernel, every process the run left behind; the run's tmpfs lives until the runner exits;
- the runner never needs ``CAP_KILL`` or ``CAP_DAC_OVERRIDE``: it signals only init (root),
  and reads the run's files with the run's file-system uid;
- output is captured up to the cap (head and tail kept), the rest counted, never buffered.
"""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import signal
import socket
import stat
import time

from services.sandbox import linux, run_process
from services.sandbox.capture import CappedBuffer
from services.sandbox.cgroups import SlotCgroup, write_limits
from services.sandbox.protocol import RunOutcome, RunSpec, pack, recv_frame

_NS_FLAGS = linux.CLONE_NEWNS | linux.CLONE_NEWPID | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS
SLOT_NETNS: dict[int, int] = {}  # slot -> fd of its empty network namespace (see create_slot_netns)
SLEEP = next((p for p in ("/usr/bin/sleep", "/bin/sleep") if os.access(p, os.X_OK)), "")
_KILL_DRAIN_S = 2.0
_INIT_GRACE_S = 30  # init outlives the wall limit by this much even if its runner vanished


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


def serve_connection(conn: socket.socket) -> None:
    """Entry point of a freshly forked runner: one request in, one outcome out."""
    try:
        spec = RunSpec(**recv_frame(conn))
        outcome = execute(spec)
    except Exception as exc:  # any failure here is the sandbox's, reported as SandboxError
        outcome = RunOutcome(ok=False, error=f"{type(exc).__name__}: {exc}")
    conn.sendall(pack(outcome))


def execute(spec: RunSpec) -> RunOutcome:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    netns = SLOT_NETNS.get(spec.slot)
    if netns is not None:
        linux.setns(netns, linux.CLONE_NEWNET)
    linux.unshare(_NS_FLAGS | (linux.CLONE_NEWNET if netns is None else 0))
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe()
    st_r, st_w = os.pipe()
    cgroup = SlotCgroup(spec.cgroup_limits, spec.cgroup_procs) if spec.cgroup_procs else None
    if cgroup is not None and cgroup.limits:  # sent only when this slot's limits change
        write_limits(cgroup, spec.cgroup_memory_bytes, spec.max_processes)
    start = time.monotonic()
    # pid 1 of the new namespace: spawned (no copy of this heap), so the run can be pid 2
    init = os.posix_spawn(SLEEP, ["sleep", str(math.ceil(spec.timeout_s) + _INIT_GRACE_S)], {})
    try:
        pid = os.fork()
    except OSError:
        _kill_init(init)
        raise
    if pid == 0:
        for fd in (out_r, err_r, in_w, st_r):
            os.close(fd)
        run_process.run(spec, cgroup, in_r, out_w, err_w, st_w)  # never returns
    for fd in (out_w, err_w, in_r, st_w):
        os.close(fd)
    out, err = CappedBuffer(spec.max_output_bytes), CappedBuffer(spec.max_output_bytes)
    timed_out, ended = _collect(pid, init, start + spec.timeout_s, spec.stdin, {out_r: out, err_r: err}, in_w)
    _, wait_status = os.waitpid(pid, 0)
    os.waitpid(init, 0)
    with os.fdopen(st_r, "rb") as fh:
        setup_error = fh.read().decode(errors="replace")
    if setup_error:
        return RunOutcome(ok=False, error=f"sandbox setup failed: {setup_error}")
    return_code = None if timed_out else _decode_wait_status(wait_status)
    files, notes = ({}, {}) if timed_out else _fetch(spec)
    return RunOutcome(return_code=return_code, timed_out=timed_out,
                      execution_time=spec.timeout_s if timed_out else ended - start,
                      stdout=out.render(), stderr=err.render(), stdout_truncated=out.dropped,
                      stderr_truncated=err.dropped, files=files, fetch_notes=notes)


def _decode_wait_status(status: int) -> int:
    """Exit code, or minus the signal that ended the run (as ``subprocess`` reports it)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _kill_init(init: int) -> None:
    """End the run's pid namespace: the kernel kills every process left in it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(init, signal.SIGKILL)


def _collect(pid: int, init: int, deadline: float, stdin: bytes, streams: dict[int, CappedBuffer],
             in_w: int) -> tuple[bool, float]:
    """Pump stdin/stdout/stderr until the run process ends and every stream is closed.

    Returns (timed out, when the run process ended). At the end of the run process, or at
    ``deadline``, init is killed, which closes every stream still held in the namespace.
    """
    sel = selectors.DefaultSelector()
    for fd in streams:
        sel.register(fd, selectors.EVENT_READ)
    pidfd = os.pidfd_open(pid)
    sel.register(pidfd, selectors.EVENT_READ)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(in_w, False)
        sel.register(in_w, selectors.EVENT_WRITE)
    else:
        os.close(in_w)
    open_streams = set(streams)
    ended: float | None = None
    timed_out = killed = False
    while open_streams or ended is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if killed:  # namespace should be gone; stop waiting on stray writers
                break
            _kill_init(init)
            killed, timed_out = True, ended is None
            deadline = time.monotonic() + _KILL_DRAIN_S
            continue
        for key, _ in sel.select(remaining):
            fd = key.fd
            if fd == pidfd:
                ended = time.monotonic()
                sel.unregister(pidfd)
                _kill_init(init)  # whatever the run left behind ends with it
                killed = True
                deadline = ended + _KILL_DRAIN_S
            elif fd == in_w:
                try:
                    n = os.write(in_w, pending[:65536])
                    pending = pending[n:]
                except (BrokenPipeError, BlockingIOError):
                    pending = pending[:0]
                if not pending:
                    sel.unregister(in_w)
                    os.close(in_w)
            else:
                chunk = os.read(fd, 65536)
                if chunk:
                    streams[fd].feed(chunk)
                else:
                    sel.unregister(fd)
                    os.close(fd)
                    open_streams.discard(fd)
    for fd in list(open_streams) + ([in_w] if pending else []):
        with contextlib.suppress(OSError):
            os.close(fd)
    os.close(pidfd)
    return timed_out, ended if ended is not None else time.monotonic()


def _fetch(spec: RunSpec) -> tuple[dict[str, bytes], dict[str, str]]:
    """Read the requested files from the run's tmpfs, one by one: (contents, why-not notes).

    A relative path is relative to the working directory; an absolute one must lie in the
    run's ``/tmp``. Symlinks are resolved and must stay on that tmpfs; non-regular and
    too-large files are skipped. Runs after every process of the run is dead (nothing can
    swap a path under us), with the run's file-system uid (its files, its permissions).
    """
    files: dict[str, bytes] = {}
    notes: dict[str, str] = {}
    if not spec.fetch_files:
        return files, notes
    tmp_dev = os.stat("/tmp").st_dev
    linux.set_fs_ids(spec.uid, spec.uid)
    try:
        for name in spec.fetch_files:
            why = _fetch_one(name, spec.max_fetch_file_bytes, tmp_dev, files)
            if why:
                notes[name] = why
    finally:
        linux.set_fs_ids(0, 0)
    return files, notes


def _fetch_one(name: str, max_bytes: int, tmp_dev: int, files: dict[str, bytes]) -> str:
    if not name or "\x00" in name:
        return "invalid path"
    path = os.path.realpath(os.path.join(run_process.WORKDIR, name))
    if not path.startswith("/tmp/"):
        return "outside the run's /tmp"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return "not found"
    except OSError as exc:
        return f"not readable: {exc.strerror}"
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
