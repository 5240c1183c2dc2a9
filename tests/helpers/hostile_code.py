"""Hostile programs the containment tests send to the sandbox, and how to read their verdict.

Invariant: no sleep decides a verdict. A program waits, with a deadline, for a condition it
can observe itself (every child has allocated and said so, or has been killed), then reports.
"""

from __future__ import annotations

from dataclasses import dataclass

_FORKED_MEMORY_BOMB = """
import os, time
kids = []
for _ in range({children}):
    pid = os.fork()
    if pid == 0:
        b = bytearray({mb} * 2**20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        open(f"held-{{os.getpid()}}", "w").close()
        time.sleep(120)  # keep holding it until the run ends
        os._exit(0)
    kids.append(pid)
dead, deadline = set(), time.monotonic() + {settle_s}
while time.monotonic() < deadline:
    for pid in set(kids) - dead:
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            dead.add(pid)
    if all(pid in dead or os.path.exists(f"held-{{pid}}") for pid in kids):
        break
    time.sleep(0.05)
settled = all(pid in dead or os.path.exists(f"held-{{pid}}") for pid in kids)
holding = [pid for pid in kids if pid not in dead and os.path.exists(f"held-{{pid}}")]
print("settled", settled, "allocated", len(os.listdir(".")), "holding", len(holding), "killed", len(dead))
"""


def forked_memory_bomb(children: int, mb: int, settle_s: float) -> str:
    """A run that forks ``children`` processes which each touch ``mb`` MB and hold it.

    Each child that got its memory leaves a ``held-PID`` file; the parent waits until every
    child has either done so or been killed (at most ``settle_s``) and prints the counts.
    """
    return _FORKED_MEMORY_BOMB.format(children=children, mb=mb, settle_s=settle_s)


@dataclass(frozen=True)
class MemoryBombVerdict:
    settled: bool  # every child allocated or was killed before the deadline
    allocated: int  # ``held-*`` files left: children that got their memory at some point
    holding: int  # children alive and holding their memory at the end
    killed: int

    @classmethod
    def parse(cls, stdout: str) -> MemoryBombVerdict:
        words = stdout.split()
        if len(words) != 8 or words[0] != "settled":
            raise AssertionError(f"not a memory-bomb report: {stdout!r}")
        return cls(words[1] == "True", int(words[3]), int(words[5]), int(words[7]))
