"""Per-slot cgroups: a run's memory limit covers all its processes and its tmpfs together.

``RLIMIT_DATA`` bounds each process of a run; a run that forks could still multiply it.
When the host lets us (cgroup v1 ``memory`` + ``pids`` hierarchies, or cgroup v2 with both
controllers delegated to our cgroup), every execution slot gets its own cgroup; the runner
writes the run's limits into it and the run joins it before it executes anything.
Invariant: a slot's cgroup holds at most one run at a time (slots are exclusive), so its
limits are that run's limits. Without cgroups the service still starts, says so in
``/healthz`` and in an error log line, and relies on the per-process limits.

In a container, the engine mounts the cgroup tree read-only. When the container has a
cgroup namespace of its own (Docker/compose ``cgroup: private``; the default on cgroup v2
hosts) and the service has ``CAP_SYS_ADMIN`` (which its per-run namespaces need anyway),
it mounts a fresh, writable cgroup hierarchy over the read-only one. The root of that
mount is the container's own cgroup (the namespace's root), so the service can subdivide
what the engine gave the container and nothing else; the container's own limits still
cap the whole.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from services.common.logging import get_logger
from services.sandbox import linux

log = get_logger("sandbox.cgroups")

CGROUP_ROOT = "/sys/fs/cgroup"
INIT_CGROUP_NS_INO = 0xEFFFFFFB  # the kernel's PROC_CGROUP_INIT_INO: the host's cgroup namespace
SERVICE_LEAF = "retool-service"  # v2: where the container's own processes move (no internal processes)


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


def _own_cgroup_namespace() -> bool:
    """True in a cgroup namespace other than the host's, rooted at our own cgroup."""
    try:
        private = os.stat("/proc/self/ns/cgroup").st_ino != INIT_CGROUP_NS_INO
        return private and set(_own_paths().values()) == {"/"}
    except OSError:
        return False


def _hierarchy_options(kind: str) -> str | None:
    """The v1 mount options naming ``kind``'s hierarchy (e.g. ``memory``, or ``cpu,cpuacct``)."""
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            controllers = line.split(":", 2)[1]
            if kind in controllers.split(","):
                return controllers
    return None


_MOUNT_FLAGS = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC


def _overmount(target: str, fstype: str, options: str | None) -> None:
    """Mount a cgroup filesystem at ``target``, over the read-only one already there.

    The kernel refuses to mount a filesystem straight onto a mount of the same superblock and
    root (EBUSY), which the engine's read-only mount is; an empty tmpfs in between separates them.
    """
    linux.mount("tmpfs", target, "tmpfs", _MOUNT_FLAGS, "size=4k,mode=755")
    linux.mount("cgroup", target, fstype, _MOUNT_FLAGS, options)


def mount_private_hierarchy() -> str | None:
    """Mount a writable cgroup hierarchy over the read-only one of our own cgroup namespace.

    Returns None when done, else why not (the caller logs it). Only in a private cgroup
    namespace (so the mount's root is our own cgroup, never the host's) and as root.
    """
    if os.geteuid() != 0:
        return "not root"
    if not _own_cgroup_namespace():
        return "no private cgroup namespace (Docker: cgroup: private / --cgroupns=private)"
    try:
        if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
            _overmount(CGROUP_ROOT, "cgroup2", None)
            _delegate_v2_root()
        else:
            for kind in ("memory", "pids"):
                options = _hierarchy_options(kind)
                target = os.path.join(CGROUP_ROOT, kind)
                if options is None or not os.path.isdir(target):
                    return f"no cgroup v1 {kind} hierarchy at {target}"
                _overmount(target, "cgroup", options)
    except OSError as exc:
        return f"mounting a writable cgroup hierarchy failed ({exc}; needs CAP_SYS_ADMIN and mount(2) " \
               "allowed by seccomp/AppArmor)"
    return None


def _delegate_v2_root() -> None:
    """Enable memory+pids for children of the namespace root (cgroup v2).

    v2 lets a cgroup hand controllers to children only while it holds no processes itself,
    so every process of the container moves into a leaf first.
    """
    leaf = os.path.join(CGROUP_ROOT, SERVICE_LEAF)
    os.makedirs(leaf, exist_ok=True)
    for _ in range(100):  # processes may fork while we move them
        with open(os.path.join(CGROUP_ROOT, "cgroup.procs")) as fh:
            pids = fh.read().split()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError), open(os.path.join(leaf, "cgroup.procs"), "w") as fh:
                fh.write(pid)
    with open(os.path.join(CGROUP_ROOT, "cgroup.subtree_control"), "w") as fh:
        fh.write("+memory +pids")


class CgroupPlan:
    def __init__(self, version: int, bases: dict[str, str]) -> None:
        self.version = version
        self.bases = bases  # kind -> directory holding the slot cgroups

    @classmethod
    def detect(cls, name: str) -> CgroupPlan | None:
        """The cgroup layout we can use, or None; creates the parent directories.

        When the tree is read-only in a private cgroup namespace, mounts a writable one first.
        """
        plan = cls._usable(name)
        if plan is not None:
            return plan
        why = mount_private_hierarchy()
        if why is not None:
            log.error("cannot get a writable cgroup tree: %s", why)
            return None
        return cls._usable(name, ns_root=True)

    @classmethod
    def _usable(cls, name: str, ns_root: bool = False) -> CgroupPlan | None:
        try:
            own = _own_paths()
        except OSError:
            return None
        unified = os.path.join(CGROUP_ROOT, "cgroup.controllers")
        if os.path.exists(unified):
            # our own v2 mount: slots go under the namespace root (we moved into a leaf)
            parent = CGROUP_ROOT if ns_root else os.path.join(CGROUP_ROOT, own.get("", "/").lstrip("/"))
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
