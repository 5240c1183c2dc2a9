"""One sandboxed run, executed in a process forked from a warm zygote.

Process tree of a run::

    runner  (root; fresh mount/net/pid/ipc/uts namespaces)  enforces the wall limit, reads output
      run   (pid 1 of the run's pid namespace)               mounts its private tmpfs, writes the
                                                             input files, then drops to the run's
                                                             uid and executes the model's code

Invariants:
- the run has no network (a fresh, unconfigured network namespace: not even loopback),
  sees only its own processes (fresh /proc), cannot write anywhere but its private tmpfs
  (the zygote remounted every inherited mount read-only), runs as an unprivileged uid no
  other concurrent run shares, with no_new_privs, and inherits no descriptor but
  stdin/stdout/stderr;
- the run is pid 1 of its namespace: when it exits, or is killed at the wall limit, the
  kernel kills every process it left behind, and its tmpfs vanishes with the namespace.
  (As for any container's pid 1, a signal it sends itself without a handler is ignored.)
- output is captured up to the cap (head and tail kept), the rest counted, never buffered.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import selectors
import signal
import socket
import stat
import time

from services.sandbox import linux, user_main
from services.sandbox.cgroups import SlotCgroup, join, write_limits
from services.sandbox.protocol import RunOutcome, RunSpec, pack, recv_frame

WORKDIR = "/tmp/workspace"
CODE_FILENAME = "main.py"
_NS_FLAGS = linux.CLONE_NEWNS | linux.CLONE_NEWPID | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS
SLOT_NETNS: dict[int, int] = {}  # slot -> fd of its empty network namespace (see create_slot_netns)


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
_KILL_DRAIN_S = 2.0


class CappedBuffer:
    """Keeps the first and last ``cap // 2`` bytes of a stream and counts what is dropped."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap - cap // 2
        self.tail_cap = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap:
            self.tail += data
            if len(self.tail) > self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    @property
    def dropped(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def render(self) -> bytes:
        if self.dropped == 0:
            return bytes(self.head + self.tail)
        marker = f"\n...[output truncated: {self.dropped} bytes omitted]...\n".encode()
        return bytes(self.head) + marker + bytes(self.tail)


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
    pid = os.fork()
    if pid == 0:  # pid 1 of the new pid namespace
        for fd in (out_r, err_r, in_w):
            os.close(fd)
        _run(spec, cgroup, in_r, out_w, err_w, st_w)  # never returns
    for fd in (out_w, err_w, in_r, st_w):
        os.close(fd)
    out, err = CappedBuffer(spec.max_output_bytes), CappedBuffer(spec.max_output_bytes)
    timed_out = _collect(pid, start + spec.timeout_s, spec.stdin, {out_r: out, err_r: err}, in_w)
    _, wait_status = os.waitpid(pid, 0)
    elapsed = time.monotonic() - start
    with os.fdopen(st_r, "rb") as fh:
        setup_error = fh.read().decode(errors="replace")
    if setup_error:
        return RunOutcome(ok=False, error=f"sandbox setup failed: {setup_error}")
    return_code = None if timed_out else _decode_wait_status(wait_status)
    files = {} if timed_out else _fetch(spec)
    return RunOutcome(return_code=return_code, timed_out=timed_out,
                      execution_time=min(elapsed, spec.timeout_s) if timed_out else elapsed,
                      stdout=out.render(), stderr=err.render(), stdout_truncated=out.dropped,
                      stderr_truncated=err.dropped, files=files)


def _decode_wait_status(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _collect(pid: int, deadline: float, stdin: bytes, streams: dict[int, CappedBuffer], in_w: int) -> bool:
    """Pump stdin/stdout/stderr until the run's namespace is gone; SIGKILL it at ``deadline``."""
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
    exited = killed = False
    while open_streams or not exited:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if killed:  # namespace should be gone; stop waiting on stray writers
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed = True
            deadline = time.monotonic() + _KILL_DRAIN_S
            continue
        for key, _ in sel.select(remaining):
            fd = key.fd
            if fd == pidfd:
                exited = True
                sel.unregister(pidfd)
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
    return killed


def remount_readonly(keep_writable: frozenset[str] = frozenset()) -> None:
    """Make every mount of the current (private) mount namespace read-only, but ``keep_writable``."""
    for target, opts in linux.mount_points():
        if target in keep_writable:
            continue
        flags = linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY
        for name, bit in (("nosuid", linux.MS_NOSUID), ("nodev", linux.MS_NODEV),
                          ("noexec", linux.MS_NOEXEC)):
            if name in opts:
                flags |= bit
        try:
            linux.mount(None, target, None, flags)
        except OSError:
            if target == "/":
                raise  # fail closed: a writable root is not a sandbox


def _prepare_filesystem(spec: RunSpec) -> None:
    linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    linux.mount("tmpfs", "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"size={spec.workdir_size_mb}m,mode=1777")
    for target, private in (("/var/tmp", "/tmp/.var-tmp"), ("/dev/shm", "/tmp/.shm")):
        if os.path.isdir(target):  # share the one size-limited tmpfs
            os.mkdir(private)
            os.chmod(private, 0o1777)
            linux.mount(private, target, None, linux.MS_BIND)
    os.mkdir(WORKDIR, 0o700)
    for rel, data in spec.files.items():
        path = os.path.join(WORKDIR, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    for root, dirs, names in os.walk(WORKDIR):
        for name in dirs + names:
            os.chown(os.path.join(root, name), spec.uid, spec.uid)
    os.chown(WORKDIR, spec.uid, spec.uid)
    os.chdir(WORKDIR)


def _vm_data_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _run(spec: RunSpec, cgroup: SlotCgroup | None, in_r: int, out_w: int, err_w: int, st_w: int) -> None:
    """pid 1 of the run: set up as root, drop privileges, run the code, exit with its code."""
    code = 1
    try:
        if cgroup is not None:
            join(cgroup)
        _prepare_filesystem(spec)
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        max_fd = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        os.closerange(3, st_w)
        os.closerange(st_w + 1, max_fd)
        _apply_limits(spec)
        os.setgroups([])
        os.setresgid(spec.uid, spec.uid, spec.uid)
        os.setresuid(spec.uid, spec.uid, spec.uid)
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
        os.close(st_w)  # setup done: nothing to report
        code = user_main.run_user_code(spec.code, WORKDIR, CODE_FILENAME)
    except BaseException as exc:  # noqa: BLE001 - setup failures reach the runner, never raise
        with contextlib.suppress(OSError):
            os.write(st_w, f"{type(exc).__name__}: {exc}".encode())
    finally:
        os._exit(code)


def _apply_limits(spec: RunSpec) -> None:
    mem = spec.memory_mb * 1024 * 1024
    cpu = math.ceil(spec.timeout_s) + 1
    limits = {
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_NPROC: spec.max_processes,
        resource.RLIMIT_CPU: cpu,
        resource.RLIMIT_FSIZE: spec.workdir_size_mb * 1024 * 1024,
        resource.RLIMIT_NOFILE: 1024,
        # memory the run may allocate on top of the warm interpreter it was forked from
        resource.RLIMIT_DATA: _vm_data_bytes() + mem,
    }
    for res, value in limits.items():
        resource.setrlimit(res, (value, value))


def _fetch(spec: RunSpec) -> dict[str, bytes]:
    """Read requested files from the run's workdir; symlinks out of it and non-files are ignored.

    Runs after every process of the run is dead, so nothing can swap a path under us.
    """
    root = os.path.realpath(WORKDIR) + os.sep
    files: dict[str, bytes] = {}
    for rel in spec.fetch_files:
        path = os.path.realpath(os.path.join(WORKDIR, rel))
        if not path.startswith(root):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if stat.S_ISREG(st.st_mode) and st.st_size <= spec.max_fetch_file_bytes:
                files[rel] = fh.read(spec.max_fetch_file_bytes)
    return files
