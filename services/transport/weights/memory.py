"""Keep freed message buffers in the process instead of returning them to the OS.

A weight push allocates and frees one multi-MiB buffer per message on both ends. With glibc's
defaults such buffers are mmapped and unmapped each time, so every message pays page faults
for fresh memory — on a VM that costs more than the copy itself. ``keep_freed_buffers`` raises
the mmap threshold above the message size and the trim threshold well above it, so the same
heap memory is reused from message to message. Invariant: it only changes glibc's tuning
(idempotent, process-wide, a no-op elsewhere); the process may keep up to ``trim_bytes`` of
freed heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_buffers(mmap_threshold: int = 64 << 20, trim_bytes: int = 1 << 30) -> bool:
    """Tune glibc malloc once per process; False where it is not glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))
    _done = ok
    return ok
