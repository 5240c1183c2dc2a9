"""Per-slot cgroups: a run's memory, process and CPU limits cover all its processes together.

``RLIMIT_DATA`` bounds each process of a run; a run that forks could still multiply it, and a
run with many threads could take every core. When the host lets us (cgroup v1 ``memory``,
``pids`` and ``cpu`` hierarchies, or cgroup v2 with the three controllers delegated to our
cgroup), every execution slot gets its own cgroup under one parent; the zygote writes the
run's limits into it and the run joins it before it executes anything.

Invariants:
- a slot's cgroup holds at most one run at a time (slots are exclusive), so its limits are
  that run's limits; CPU is ``cpu_cores`` of quota per period;
- the service and its zygotes stay outside the runs' parent cgroup, which weighs as much as
  ``os.cpu_count()`` ordinary processes: however many runs spin, the service is one more
  process to the scheduler and keeps answering;
- the zygote reaches slot files only through descriptors of the parents taken before it
  entered its own root (``hold``), so no cgroup tree is mounted inside the runs' view;
- without any of the three controllers ``CgroupPlan.detect`` returns None (or a plan missing
  it, see ``missing``): the service refuses to start unless ``isolation: degraded``.

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
KINDS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
_HELD: dict[str, int] = {}  # zygote: parent directory -> descriptor (see ``hold``)


@dataclass(frozen=True)
class SlotCgroup:
    """Files the runner writes for one slot: ``limits`` before the run, ``procs`` to join."""

    # file -> kind: "memory" | "zero" | "pids" | "cpu_quota" | "cpu_period" | "cpu_max"
    limits: dict[str, str]
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
            for kind in KINDS:
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
    _enable_v2(CGROUP_ROOT)


def _enable_v2(parent: str) -> set[str]:
    """Enable what it can of memory, pids and cpu for ``parent``'s children; returns what is on."""
    for kind in KINDS:
        with contextlib.suppress(OSError), open(os.path.join(parent, "cgroup.subtree_control"), "w") as fh:
            fh.write(f"+{kind}")
    with open(os.path.join(parent, "cgroup.subtree_control")) as fh:
        return set(fh.read().split()) & set(KINDS)


def _runs_weight(path: str, version: int) -> None:
    """The runs' parent weighs as much as ``os.cpu_count()`` ordinary processes (see invariants)."""
    cpus = os.cpu_count() or 1
    name, value = ("cpu.shares", 1024 * cpus) if version == 1 else ("cpu.weight", min(100 * cpus, 10000))
    with contextlib.suppress(OSError), open(os.path.join(path, name), "w") as fh:
        fh.write(str(value))


class CgroupPlan:
    def __init__(self, version: int, bases: dict[str, str]) -> None:
        self.version = version
        self.bases = bases  # kind -> directory holding the slot cgroups

    @property
    def missing(self) -> list[str]:
        """Controllers of ``KINDS`` this plan cannot enforce."""
        return [k for k in KINDS if k not in self.bases]

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
            _remove_stale(parent)
            os.makedirs(base, exist_ok=True)
            _runs_weight(base, 2)
            on = _enable_v2(base) & enabled
            return cls(2, {kind: base for kind in KINDS if kind in on})
        bases = {}
        for kind in KINDS:
            mount = os.path.join(CGROUP_ROOT, kind)
            parent = os.path.join(mount, own.get(kind, "/").lstrip("/"))
            if not _writable_dir(parent):
                if kind == "cpu":
                    continue  # reported by ``missing``
                return None
            bases[kind] = os.path.join(parent, name)
        for kind, base in bases.items():
            _remove_stale(os.path.dirname(base))
            os.makedirs(base, exist_ok=True)
            if kind == "cpu":
                _runs_weight(base, 1)
        return cls(1, bases)

    def slot(self, index: int) -> SlotCgroup:
        dirs = {kind: os.path.join(base, f"slot-{index}") for kind, base in self.bases.items()}
        for d in set(dirs.values()):
            os.makedirs(d, exist_ok=True)
        if self.version == 2:
            d = dirs["memory"]
            limits = {os.path.join(d, "memory.max"): "memory", os.path.join(d, "memory.swap.max"): "zero",
                      os.path.join(d, "pids.max"): "pids"}
            if "cpu" in dirs:
                limits[os.path.join(d, "cpu.max")] = "cpu_max"
            return SlotCgroup(limits, [os.path.join(d, "cgroup.procs")])
        limits = {os.path.join(dirs["memory"], "memory.limit_in_bytes"): "memory",
                  os.path.join(dirs["pids"], "pids.max"): "pids"}
        swap = os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")
        if os.path.exists(swap):
            limits[swap] = "memory"
        if "cpu" in dirs:
            limits[os.path.join(dirs["cpu"], "cpu.cfs_period_us")] = "cpu_period"
            limits[os.path.join(dirs["cpu"], "cpu.cfs_quota_us")] = "cpu_quota"
        return SlotCgroup(limits, [os.path.join(d, "cgroup.procs") for d in sorted(set(dirs.values()))])

    def parents(self) -> list[str]:
        """The directories holding the slot cgroups (what a zygote ``hold``s)."""
        return sorted(set(self.bases.values()))

    def remove(self) -> None:
        for base in set(self.bases.values()):
            with contextlib.suppress(OSError):
                for name in os.listdir(base):
                    if name.startswith("slot-"):
                        os.rmdir(os.path.join(base, name))
                os.rmdir(base)


def _remove_stale(parent: str) -> None:
    """Remove ``retool-sandbox-<pid>`` cgroups of services that died without cleaning up (their
    pid no longer exists); busy or foreign ones stay (``rmdir`` refuses non-empty cgroups)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            pid = name.removeprefix("retool-sandbox-")
            if name == pid or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
                continue
            base = os.path.join(parent, name)
            with contextlib.suppress(OSError):
                for slot in os.listdir(base):
                    if slot.startswith("slot-"):
                        os.rmdir(os.path.join(base, slot))
                os.rmdir(base)


def hold(parents: list[str]) -> None:
    """Zygote: keep a descriptor of each parent, so slot files stay reachable after ``pivot_root``."""
    for path in parents:
        _HELD[path.rstrip("/")] = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def open_file(path: str, flags: int) -> int:
    """Open a slot's file, through a held parent where there is one."""
    for parent, fd in _HELD.items():
        if path.startswith(parent + "/"):
            return os.open(path[len(parent) + 1:], flags | os.O_CLOEXEC, dir_fd=fd)
    return os.open(path, flags | os.O_CLOEXEC)


def _write(path: str, value: str) -> None:
    fd = open_file(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def read_text(path: str) -> str:
    fd = open_file(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def cpu_quota_us(cores: float) -> int:
    return max(1000, round(cores * CPU_PERIOD_US))


def write_limits(slot: SlotCgroup, memory_bytes: int, pids: int, cpu_cores: float) -> None:
    quota = cpu_quota_us(cpu_cores)
    values = {"memory": str(memory_bytes), "pids": str(pids), "zero": "0", "cpu_period": str(CPU_PERIOD_US),
              "cpu_quota": str(quota), "cpu_max": f"{quota} {CPU_PERIOD_US}"}
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
        _write(path, "0")
