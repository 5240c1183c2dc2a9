"""Thin ctypes wrappers over the Linux calls the sandbox needs (Python 3.11 lacks os.unshare).

Invariant: every wrapper raises ``OSError`` with errno on failure; nothing fails silently.
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

CLONE_NEWNS = 0x00020000
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

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


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
