"""The run's own process: set up as root inside the run's namespaces, drop to the run's uid,
execute the model's code, end.

Forked by the zygote as pid 2 of the run's pid namespace (pid 1 only sleeps and holds the
namespace; see ``runner``), so signals the code sends itself act as they do for any process.
The zygote lives in the runs' minimal root (``rootfs``), so the run's mount namespace starts
as a copy of that tree. Invariants:
- the process enters its own mount and ipc namespaces and its slot's empty network
  namespace before anything else, so the zygote's stay untouched (the uts namespace is the
  zygote's: hostname ``sandbox``, which a run cannot change);
- every step that needs privileges (cgroup, ``/proc``, ``/tmp``, input files, entering the
  working directory) happens before the uid drop; the working directory is entered while
  root still owns it, then handed to the run's uid, so no ``CAP_DAC_OVERRIDE`` is needed;
- the last step before the code is the syscall filter (``FILTER``, built once by the zygote),
  after ``no_new_privs`` and the uid drop; the capability bounding set is already empty (the
  zygote emptied its own before forking);
- a descriptor of its ``/tmp`` goes to the zygote before the drop, so the requested files
  can be fetched after every process of the run is gone;
- nothing of the sandbox stays open (only fds 0-2, and a session's own cell socket), and
  setup failures reach the zygote through the status pipe, never the code's stderr;
- the process ends through ``_exit`` bound before the code runs (or SIGKILL to itself),
  so it can never fall back into the zygote's own code.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import socket
from dataclasses import dataclass, fields

from services.sandbox import linux, rootfs, session_main, user_main
from services.sandbox.cgroups import SlotCgroup, join
from services.sandbox.phases import PhaseBoard
from services.sandbox.protocol import RunSpec

WORKDIR = "/tmp/workspace"
CODE_FILENAME = "main.py"
# Runtime directories under /tmp: each run's tmpfs at /tmp would hide them, so they are bound
# back into it (filled in by the zygote, see ``keep_tmp_runtime``).
TMP_RUNTIME: list[str] = []
FILTER: linux.SeccompProgram | None = None  # set by the zygote (None only under isolation: degraded)


@dataclass
class RunFds:
    """The pipes between the zygote and a run; ``*_r``/``in_w``/``tmp_rx`` stay with the zygote."""

    out_r: int
    out_w: int
    err_r: int
    err_w: int
    in_r: int
    in_w: int
    st_r: int  # setup failures, as text; closed unwritten when setup succeeded
    st_w: int
    tmp_rx: int  # socket pair: the run sends a descriptor of its /tmp
    tmp_tx: int
    ctl_z: int = -1  # sessions only: socket pair carrying cells in and results out
    ctl_run: int = -1

    @classmethod
    def create(cls, session: bool = False) -> RunFds:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe()
        st_r, st_w = os.pipe()
        rx, tx = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        fds = cls(out_r, out_w, err_r, err_w, in_r, in_w, st_r, st_w, rx.detach(), tx.detach())
        if session:
            z, r = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            fds.ctl_z, fds.ctl_run = z.detach(), r.detach()
        return fds

    def _close(self, *names: str) -> None:
        for name in names:
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def close_run_ends(self) -> None:
        self._close("out_w", "err_w", "in_r", "st_w", "tmp_tx", "ctl_run")

    def close_all(self) -> None:
        self._close(*(f.name for f in fields(self)))


def receive_tmp(rx: int) -> int:
    """The run's /tmp descriptor if it sent one (it did unless its setup failed early), else -1."""
    with socket.socket(fileno=os.dup(rx)) as sock:
        sock.setblocking(False)
        try:
            _, fds, _, _ = socket.recv_fds(sock, 16, 1)
        except BlockingIOError:
            return -1
    return fds[0] if fds else -1


def keep_tmp_runtime(paths: list[str]) -> None:
    """Remember the runtime directories under ``/tmp`` (outermost only) to re-expose in runs."""
    outer = [p for p in sorted(set(paths)) if p.startswith("/tmp/")]
    outer = [p for p in outer if not any(p.startswith(q + "/") for q in outer if q != p)]
    for path in outer:
        if path == WORKDIR or path.startswith(WORKDIR + "/"):
            raise ValueError(f"the runtime may not live under the runs' working directory {WORKDIR}")
        TMP_RUNTIME.append(path)


def _enter_namespaces(netns: int | None) -> None:
    # the zygote's mounts are all private already: the copy needs no propagation change
    if netns is not None:
        linux.setns(netns, linux.CLONE_NEWNET)
    linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWIPC | (linux.CLONE_NEWNET if netns is None else 0))


def _prepare_filesystem(spec: RunSpec, tmp_tx: int) -> None:
    rootfs.mount_run_proc()
    # handles on the runtime under /tmp, taken in this mount namespace before the tmpfs hides it
    hidden = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in TMP_RUNTIME]
    linux.mount("tmpfs", "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"size={spec.workdir_size_mb}m,mode=1777")
    os.mkdir(rootfs.SHM_DIR)  # /dev/shm (and /var/tmp) lead into the one size-limited tmpfs
    os.chmod(rootfs.SHM_DIR, 0o1777)
    tmp = os.open("/tmp", os.O_PATH | os.O_DIRECTORY)
    with socket.socket(fileno=os.dup(tmp_tx)) as sock:
        socket.send_fds(sock, [b"t"], [tmp])
    os.close(tmp)
    for path, fd in hidden:
        os.makedirs(path, 0o755, exist_ok=True)
        linux.mount(f"/proc/self/fd/{fd}", path, None, linux.MS_BIND | linux.MS_REC)
        linux.mount(None, path, None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID
                    | linux.MS_NODEV)
        os.close(fd)
    os.mkdir(WORKDIR, 0o700)
    for rel, data in spec.files.items():
        path = os.path.join(WORKDIR, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    os.chdir(WORKDIR)  # entered while root owns it: after the chown below, only the run's uid may
    for root, dirs, names in os.walk(WORKDIR):
        for name in dirs + names:
            os.chown(os.path.join(root, name), spec.uid, spec.uid)
    os.chown(WORKDIR, spec.uid, spec.uid)


def _vm_data_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _apply_limits(spec: RunSpec) -> None:
    mem = spec.memory_mb * 1024 * 1024
    limits = {
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_NPROC: spec.max_processes,
        resource.RLIMIT_CPU: math.ceil(spec.timeout_s) + 1,
        resource.RLIMIT_FSIZE: spec.workdir_size_mb * 1024 * 1024,
        resource.RLIMIT_NOFILE: 1024,
        # memory the run may allocate on top of the warm interpreter it was forked from
        resource.RLIMIT_DATA: _vm_data_bytes() + mem,
        # the main thread's stack may grow this far (the zygote was exec'd with room for it)
        resource.RLIMIT_STACK: spec.stack_bytes,
    }
    for res, value in limits.items():
        resource.setrlimit(res, (value, value))


def _close_all_but(keep: set[int], max_fd: int) -> None:
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, max_fd)


def run(spec: RunSpec, cgroup: SlotCgroup | None, netns: int | None, fds: RunFds, board: PhaseBoard) -> None:
    """Entry point of the run's process (forked by the zygote); never returns."""
    exit_now, kill, getpid, sigkill = os._exit, os.kill, os.getpid, signal.SIGKILL
    mark, slot, base_exc = board.mark, spec.slot, BaseException
    end_mark = board.bound_mark(slot, 5)  # usable whatever the code does to modules
    code, st_w = 1, fds.st_w
    try:
        mark(slot, 0)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        _enter_namespaces(netns)
        mark(slot, 1)
        if cgroup is not None:
            join(cgroup)
        mark(slot, 2)
        _prepare_filesystem(spec, fds.tmp_tx)
        mark(slot, 3)
        os.dup2(fds.in_r, 0)
        os.dup2(fds.out_w, 1)
        os.dup2(fds.err_w, 2)
        ctl = fds.ctl_run
        _close_all_but({st_w, ctl} - {-1}, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        _apply_limits(spec)
        os.setgroups([])
        os.setresgid(spec.uid, spec.uid, spec.uid)
        os.setresuid(spec.uid, spec.uid, spec.uid)
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        if FILTER is not None:
            FILTER.install()
        mark(slot, 4)
        os.close(st_w)  # setup done: nothing to report
        st_w = -1
    except BaseException as exc:  # noqa: BLE001 - setup failures reach the zygote, never raise
        with contextlib.suppress(OSError):
            os.write(st_w, f"{type(exc).__name__}: {exc}".encode())
        exit_now(1)
    try:
        if spec.session:
            code = session_main.serve(ctl, WORKDIR)
        else:
            code = user_main.run_user_code(spec.code, WORKDIR, CODE_FILENAME)
    finally:
        try:  # noqa: SIM105 - contextlib.suppress looks names up when it exits
            end_mark()
        except base_exc:  # noqa: BLE001 - the code broke what the mark uses: no mark, still exit
            pass
        exit_now(code)
        kill(getpid(), sigkill)  # unreachable unless _exit itself was subverted
