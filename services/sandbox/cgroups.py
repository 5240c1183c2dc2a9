"""Per-slot cgroups: a run's memory limit covers all its processes and its tmpfs together.

``RLIMIT_DATA`` bounds each process of a run; a run that forks could still multiply it.
When the host lets us (cgroup v1 ``memory`` + ``pids`` hierarchies, or cgroup v2 with both
controllers delegated to our cgroup), every execution slot gets its own cgroup; the runner
writes the run's limits into it and the run joins it before it executes anything.
Invariant: a slot's cgroup holds at most one run at a time (slots are exclusive), so its
limits are that run's limits. Without cgroups the service still starts, says so in
``/healthz``, and relies on the per-process limits.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class SlotCgroup:
    """Files the runner writes for one slot: ``limits`` before the run, ``procs`` to join."""

    limits: dict[str, str]  # file -> kind ("memory" | "pids")
    procs: list[str]


def _own_paths() -> dict[str, str]:
    out = {}
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _writable_dir(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK)


class CgroupPlan:
    def __init__(self, version: int, bases: dict[str, str]) -> None:
        self.version = version
        self.bases = bases  # kind -> directory holding the slot cgroups

    @classmethod
    def detect(cls, name: str) -> CgroupPlan | None:
        """The cgroup layout we can use, or None; creates the parent directories."""
        try:
            own = _own_paths()
        except OSError:
            return None
        unified = os.path.join(CGROUP_ROOT, "cgroup.controllers")
        if os.path.exists(unified):
            parent = os.path.join(CGROUP_ROOT, own.get("", "/").lstrip("/"))
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as fh:
                    enabled = set(fh.read().split())
            except OSError:
                return None
            if not {"memory", "pids"} <= enabled or not _writable_dir(parent):
                return None
            base = os.path.join(parent, name)
            os.makedirs(base, exist_ok=True)
            with open(os.path.join(base, "cgroup.subtree_control"), "w") as fh:
                fh.write("+memory +pids")
            return cls(2, {"memory": base, "pids": base})
        bases = {}
        for kind in ("memory", "pids"):
            mount = os.path.join(CGROUP_ROOT, kind)
            parent = os.path.join(mount, own.get(kind, "/").lstrip("/"))
            if not _writable_dir(parent):
                return None
            bases[kind] = os.path.join(parent, name)
        for base in bases.values():
            os.makedirs(base, exist_ok=True)
        return cls(1, bases)

    def slot(self, index: int) -> SlotCgroup:
        dirs = {kind: os.path.join(base, f"slot-{index}") for kind, base in self.bases.items()}
        for d in set(dirs.values()):
            os.makedirs(d, exist_ok=True)
        if self.version == 2:
            d = dirs["memory"]
            return SlotCgroup({os.path.join(d, "memory.max"): "memory",
                               os.path.join(d, "memory.swap.max"): "zero",
                               os.path.join(d, "pids.max"): "pids"},
                              [os.path.join(d, "cgroup.procs")])
        limits = {os.path.join(dirs["memory"], "memory.limit_in_bytes"): "memory",
                  os.path.join(dirs["pids"], "pids.max"): "pids"}
        swap = os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")
        if os.path.exists(swap):
            limits[swap] = "memory"
        return SlotCgroup(limits, [os.path.join(d, "cgroup.procs") for d in sorted(set(dirs.values()))])

    def mount_points(self) -> set[str]:
        """Mounts the runners must be able to write (kept writable in the zygote's view)."""
        if self.version == 2:
            return {CGROUP_ROOT}
        return {os.path.join(CGROUP_ROOT, kind) for kind in self.bases}

    def remove(self) -> None:
        for base in set(self.bases.values()):
            with contextlib.suppress(OSError):
                for name in os.listdir(base):
                    if name.startswith("slot-"):
                        os.rmdir(os.path.join(base, name))
                os.rmdir(base)


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def write_limits(slot: SlotCgroup, memory_bytes: int, pids: int) -> None:
    values = {"memory": str(memory_bytes), "pids": str(pids), "zero": "0"}
    memsw = [p for p in slot.limits if "memsw" in p]
    plain = [p for p in slot.limits if "memsw" not in p]
    try:  # v1 refuses memsw < memory limit: raise memsw first, or lower the memory limit first
        order = memsw + plain
        for path in order:
            _write(path, values[slot.limits[path]])
    except OSError:
        if not memsw:
            raise
        for path in plain + memsw:
            _write(path, values[slot.limits[path]])


def join(slot: SlotCgroup) -> None:
    for path in slot.procs:
        with open(path, "w") as fh:
            fh.write("0")
