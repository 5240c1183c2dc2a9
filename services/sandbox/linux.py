"""Thin ctypes wrappers over the Linux calls the sandbox needs (Python 3.11 lacks os.unshare).

Invariant: every wrapper raises ``OSError`` with errno on failure; nothing fails silently.
``clone_sleeper`` is the one call that starts code outside Python: a child that shares the
caller's memory and descriptor table and only runs libc's ``sleep`` (see its docstring).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.setfsuid.argtypes = [ctypes.c_uint]
_libc.setfsgid.argtypes = [ctypes.c_uint]
_libc.pthread_attr_setstacksize.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_libc.syscall.restype = ctypes.c_long
_libc.clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
_SLEEP = ctypes.cast(_libc.sleep, ctypes.c_void_p).value

SIGCHLD = 17
CLONE_VM = 0x00000100
CLONE_FILES = 0x00000400
CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_MOVE = 8192
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SYS_PIVOT_ROOT = 155  # x86-64 (the only architecture the image is built for)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    _check(_libc.mount(enc(source), target.encode(), enc(fstype), flags, enc(data)), f"mount {target}")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), "prctl")


def set_fs_ids(uid: int, gid: int) -> None:
    """Check file access as ``uid``/``gid`` (``setfsuid``/``setfsgid``); ``0, 0`` restores root.

    Unlike ``setresuid`` this is reversible, so the zygote can read a run's files the way
    their owner would, without holding ``CAP_DAC_OVERRIDE``. Raises if the change did not take.
    """
    _libc.setfsgid(gid)
    _libc.setfsuid(uid)
    if _libc.setfsuid(0xFFFFFFFF) != uid or _libc.setfsgid(0xFFFFFFFF) != gid:  # -1 only queries
        raise OSError(1, f"setfsuid/setfsgid to {uid}/{gid} did not take effect")


def set_default_thread_stack(size: int) -> None:
    """Stack size of threads created without an explicit size (glibc's process-wide default).

    glibc derives that default from ``RLIMIT_STACK`` at exec time; the zygotes are started
    with a large stack limit (so a run's main thread may recurse deeply), which would
    otherwise give every thread a stack that large.
    """
    attr = ctypes.create_string_buffer(256)  # >= sizeof(pthread_attr_t) (56 on x86-64)
    for name, args in (("pthread_attr_init", (attr,)), ("pthread_attr_setstacksize", (attr, size)),
                       ("pthread_setattr_default_np", (attr,))):
        err = getattr(_libc, name)(*args)
        if err:
            raise OSError(err, f"{name}: {os.strerror(err)}")
    _libc.pthread_attr_destroy(attr)


def mount_points() -> list[tuple[str, set[str]]]:
    """Mount points of this mount namespace with their per-mount flags, from /proc/self/mountinfo."""
    out: list[tuple[str, set[str]]] = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            parts = line.split()
            target = parts[4].encode().decode("unicode_escape")
            out.append((target, set(parts[5].split(","))))
    return out


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def sethostname(name: str) -> None:
    _check(_libc.sethostname(name.encode(), len(name.encode())), "sethostname")


def drop_bounding_set() -> int:
    """Empty the capability bounding set (needs ``CAP_SETPCAP``); returns how many were dropped.

    Only what later ``execve``s may gain is bounded: the caller keeps the capabilities it has.
    """
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last = int(fh.read())
    dropped = 0
    for cap in range(last + 1):
        if _libc.prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1:
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"PR_CAPBSET_DROP {cap}")
            dropped += 1
    return dropped


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class SeccompProgram:
    """A classic-BPF seccomp program (as libseccomp exports it), installable without libseccomp.

    Built once (``syscall_filter.build``); ``install`` is a single ``prctl`` per process.
    """

    def __init__(self, bpf: bytes) -> None:
        if not bpf or len(bpf) % 8:
            raise ValueError(f"a BPF program is whole 8-byte instructions, not {len(bpf)} bytes")
        self._buf = ctypes.create_string_buffer(bpf, len(bpf))
        self._prog = _SockFprog(len(bpf) // 8, ctypes.addressof(self._buf))
        self._addr = ctypes.addressof(self._prog)

    def install(self) -> None:
        """Apply to the calling thread (``no_new_privs`` must be set, or ``CAP_SYS_ADMIN`` held)."""
        _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, self._addr, 0, 0), "seccomp filter")


class SleeperStacks:
    """Stacks for ``clone_sleeper`` children, one per key (a run slot), reused once reaped."""

    SIZE = 16 * 1024  # libc's sleep needs a few hundred bytes

    def __init__(self) -> None:
        self._stacks: dict[int, ctypes.Array[ctypes.c_char]] = {}

    def top(self, key: int) -> int:
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = ctypes.create_string_buffer(self.SIZE)
        return (ctypes.addressof(stack) + self.SIZE) & ~0xF


def clone_sleeper(stack_top: int, seconds: int, flags: int = 0) -> int:
    """Start a child that runs libc's ``sleep(seconds)``, then exits; returns its pid.

    The child shares the caller's memory and descriptor table (``CLONE_VM | CLONE_FILES``):
    nothing is copied, so it costs a small fraction of a fork (on this VM, where page-table
    work is expensive, ~20x less than forking a 10 MB interpreter). It never runs Python
    code and never touches the heap: only ``sleep`` on the stack given, which must stay
    allocated until the child is reaped (``SleeperStacks``). Being a child created with
    ``SIGCHLD`` it is waited for like any other. ``flags`` adds namespace flags.
    """
    pid = _libc.clone(_SLEEP, stack_top, CLONE_VM | CLONE_FILES | SIGCHLD | flags, seconds)
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clone: {os.strerror(err)}")
    return int(pid)
