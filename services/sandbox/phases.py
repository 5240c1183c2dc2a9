"""Where a run's CPU time goes: fork, namespaces, cgroup attach, mounts, filter, code, exit.

The run process records its own CPU clock (``CLOCK_PROCESS_CPUTIME_ID``, which starts at
zero at the fork) at the end of each setup step into a page shared with its zygote, one row
per slot; the zygote adds what it spent itself (the fork, the namespace's init) and, from
``wait4``, the run's total, whose remainder after the last mark is the exit (tearing down
the address space and namespaces). Invariants: recording costs no system call (a store into
memory mapped before the fork); a row is read only after its run process was reaped, and a
slot runs one process at a time, so rows are never shared; the figures are CPU seconds,
not wall time, so they stay meaningful when 32 runs share two cores.
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Callable

# marks the run process records, in order; each phase is the CPU time since the previous mark
# (``run_start``: the child's side of the fork, from the fork to its first mark)
RUN_MARKS = ("run_start", "namespaces", "cgroup", "mounts", "filter", "code")
PHASES = ("fork", "init", *RUN_MARKS, "exit")  # fork and init: the zygote's side
_ROW = struct.Struct(f"{len(RUN_MARKS)}q")
_cpu_ns = time.clock_gettime_ns
_CLOCK = time.CLOCK_PROCESS_CPUTIME_ID


class PhaseBoard:
    """The shared rows (one per slot index) of a zygote."""

    def __init__(self, slots: int) -> None:
        self.slots = max(slots, 1)
        self._mem = mmap.mmap(-1, _ROW.size * self.slots)  # MAP_SHARED | MAP_ANONYMOUS

    def row(self, slot: int) -> int:
        return (slot % self.slots) * _ROW.size

    def clear(self, slot: int) -> None:
        _ROW.pack_into(self._mem, self.row(slot), *([0] * len(RUN_MARKS)))

    def mark(self, slot: int, index: int) -> None:
        """In the run process: the CPU time used so far, as mark ``index`` of its row."""
        struct.pack_into("q", self._mem, self.row(slot) + 8 * index, _cpu_ns(_CLOCK))

    def bound_mark(self, slot: int, index: int) -> Callable[[], None]:
        """``mark`` with every name it uses bound now (called after model code has run)."""
        pack, mem, clock, which = struct.pack_into, self._mem, _cpu_ns, _CLOCK
        offset = self.row(slot) + 8 * index

        def end() -> None:
            pack("q", mem, offset, clock(which))

        return end

    def split(self, slot: int, fork_s: float, init_s: float, total_s: float) -> dict[str, float]:
        """CPU seconds per phase of a reaped run (``total_s`` from its ``wait4`` rusage)."""
        marks = [v / 1e9 for v in _ROW.unpack_from(self._mem, self.row(slot))]
        out = {"fork": fork_s, "init": init_s, "run_start": marks[0]}
        last = marks[0]
        for name, value in zip(RUN_MARKS[1:], marks[1:], strict=True):
            if value <= 0:  # the run ended (or failed) before this mark
                break
            out[name] = max(value - last, 0.0)
            last = value
        out["exit"] = max(total_s - last, 0.0)
        return out


def thread_cpu() -> float:
    return time.thread_time()
