"""The run's own process: set up as root inside the run's namespaces, drop to the run's uid,
execute the model's code, end.

Runs in a child of the runner that is pid 2 of the run's pid namespace (pid 1 is a bare
``sleep`` that holds the namespace; see ``runner``), so signals the code sends itself act
as they do for any process. Invariants:
- every step that needs privileges (cgroup, mounts, input files, entering the working
  directory) happens before the uid drop; the working directory is entered while root
  still owns it, then handed to the run's uid, so no ``CAP_DAC_OVERRIDE`` is needed;
- nothing of the sandbox stays open (only fds 0-2), and setup failures reach the runner
  through the status pipe, never the code's stderr;
- the process ends through ``_exit`` bound before the code runs (or SIGKILL to itself),
  so it can never fall back into the runner or the zygote.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal

from services.sandbox import linux, user_main
from services.sandbox.cgroups import SlotCgroup, join
from services.sandbox.protocol import RunSpec

WORKDIR = "/tmp/workspace"
CODE_FILENAME = "main.py"
# Runtime directories under /tmp: each run's tmpfs at /tmp would hide them, so they are bound
# back into it (filled in by the zygote, see ``keep_tmp_runtime``).
TMP_RUNTIME: list[str] = []


def keep_tmp_runtime(paths: list[str]) -> None:
    """Remember the runtime directories under ``/tmp`` (outermost only) to re-expose in runs."""
    outer = [p for p in sorted(set(paths)) if p.startswith("/tmp/")]
    outer = [p for p in outer if not any(p.startswith(q + "/") for q in outer if q != p)]
    for path in outer:
        if path == WORKDIR or path.startswith(WORKDIR + "/"):
            raise ValueError(f"the runtime may not live under the runs' working directory {WORKDIR}")
        TMP_RUNTIME.append(path)


def _prepare_filesystem(spec: RunSpec) -> None:
    linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    # handles on the runtime under /tmp, taken in this mount namespace before the tmpfs hides it
    hidden = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in TMP_RUNTIME]
    linux.mount("tmpfs", "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"size={spec.workdir_size_mb}m,mode=1777")
    for target, private in (("/var/tmp", "/tmp/.var-tmp"), ("/dev/shm", "/tmp/.shm")):
        if os.path.isdir(target):  # share the one size-limited tmpfs
            os.mkdir(private)
            os.chmod(private, 0o1777)
            linux.mount(private, target, None, linux.MS_BIND)
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


def run(spec: RunSpec, cgroup: SlotCgroup | None, in_r: int, out_w: int, err_w: int, st_w: int) -> None:
    """Entry point of the run's process; never returns."""
    exit_now, kill, getpid, sigkill = os._exit, os.kill, os.getpid, signal.SIGKILL
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
        st_w = -1
    except BaseException as exc:  # noqa: BLE001 - setup failures reach the runner, never raise
        with contextlib.suppress(OSError):
            os.write(st_w, f"{type(exc).__name__}: {exc}".encode())
        exit_now(1)
    try:
        code = user_main.run_user_code(spec.code, WORKDIR, CODE_FILENAME)
    finally:
        exit_now(code)
        kill(getpid(), sigkill)  # unreachable unless _exit itself was subverted
