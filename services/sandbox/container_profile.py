"""The sandbox container's own seccomp profile: the outer syscall barrier around the whole service.

Docker's and the runtimes' default profiles deny ``pivot_root(2)``, which the zygotes need to
enter the runs' minimal root, so the container cannot run under them. This profile takes their
place with Docker's semantics (deny by default, allow a list) and is built from the runs' own
deny list (``syscall_filter``): it denies what the runs' filter denies, except exactly what the
service itself calls to build a run. A process in the container that is not a run (the HTTP
service, a zygote before it forks, anything ``docker exec``\\ ed) is held to it; a run is held to
it *and* to its own stricter filter.

What the service needs, and why (``rootfs``, ``runner``, ``run_process``, ``cgroups``):
- ``unshare`` of mount, UTS, IPC, network and pid namespaces (a zygote's private root, the
  slots' network namespaces, each run's pid/mount/ipc namespaces), never a user, cgroup or
  time namespace;
- ``setns`` into a network namespace (a run enters its slot's) or a pid namespace (a zygote
  returns to its own after each fork), nothing else;
- ``mount`` and ``umount2`` (the minimal root, each run's ``/proc`` and ``/tmp``, the private
  cgroup tree), ``pivot_root`` (entering the root), ``sethostname`` (the runs' ``sandbox``).

Invariants:
- default action ``EPERM``; allowed: every x86-64 call of ``syscall_table`` but the denied and
  the argument-checked ones, so a call the table does not name (newer than it) is denied too;
- denied: ``syscall_filter.denied_calls()`` but ``SERVICE_CALLS`` (every denial of the runs'
  filter but the mount calls and ``sethostname``), and by argument (``ARG_CHECKED``):
  ``unshare`` with a namespace flag the service does not use, ``clone`` with any; ``setns``
  but into the two types above; ``personality`` but its query; the socket families the runs'
  filter denies; ``clone3`` answers ``ENOSYS`` (its flags sit in memory a filter cannot read;
  glibc falls back to ``clone``, whose flags are checked);
- an argument that is a C ``int`` (the kernel reads its low 32 bits) is only ever *allowed* on
  an exact match of all 64 bits or a masked match of the low 32: high bits set to slip past
  a comparison cannot widen what is allowed;
- only the x86-64 ABI (no ``x32``/``i386`` names): libseccomp rejects other ABIs' calls;
- the JSON is deterministic (``render``) and the committed file is checked against it
  (``scripts/gen_seccomp_profile.py``; tests/unit/test_container_profile.py).
"""

from __future__ import annotations

import json
from typing import Any

from services.sandbox import linux, syscall_filter, syscall_table

PROFILE_PATH = "deploy/docker/sandbox-seccomp.json"  # relative to the repository root
# What the service calls that the runs' filter denies outright (see the module docstring).
SERVICE_CALLS = ("mount", "umount2", "pivot_root", "sethostname")
SERVICE_NAMESPACES = (linux.CLONE_NEWNS | linux.CLONE_NEWUTS | linux.CLONE_NEWIPC | linux.CLONE_NEWNET
                      | linux.CLONE_NEWPID)
SERVICE_SETNS_TYPES = (linux.CLONE_NEWNET, linux.CLONE_NEWPID)
ARG_CHECKED = ("clone", "clone3", "unshare", "setns", "personality", "socket")
LOW32 = syscall_filter.LOW32
AF_MAX = 46  # socket families are 0..45 (Linux 6.1); the kernel refuses the rest


def denied_calls() -> tuple[str, ...]:
    """Calls denied whatever their arguments: the runs' denials the service does not need
    (``unshare`` and ``setns``, which it needs for some arguments, are argument-checked)."""
    keep = set(SERVICE_CALLS) | set(ARG_CHECKED)
    return tuple(name for name in syscall_filter.denied_calls() if name not in keep)


def allowed_calls() -> list[str]:
    """Calls allowed whatever their arguments, in the table's (number) order."""
    skip = set(denied_calls()) | set(ARG_CHECKED)
    return [name for name in syscall_table.X86_64 if name not in skip]


def aligned_blocks(values: set[int]) -> list[tuple[int, int]]:
    """``values`` as the fewest aligned power-of-two blocks ``(base, size)`` (like CIDR ranges)."""
    blocks: list[tuple[int, int]] = []
    v = 0
    top = max(values, default=-1)
    while v <= top:
        if v not in values:
            v += 1
            continue
        size = 1
        while v % (size * 2) == 0 and all(x in values for x in range(v, v + size * 2)):
            size *= 2
        blocks.append((v, size))
        v += size
    return blocks


def _rule(name: str, *args: dict[str, Any], action: str = "SCMP_ACT_ALLOW", errno: int | None = None
          ) -> dict[str, Any]:
    rule: dict[str, Any] = {"names": [name], "action": action}
    if errno is not None:
        rule["errnoRet"] = errno
    if args:
        rule["args"] = list(args)
    return rule


def _arg(index: int, op: str, value: int, value_two: int = 0) -> dict[str, Any]:
    return {"index": index, "value": value, "valueTwo": value_two, "op": op}


def profile() -> dict[str, Any]:
    """The profile as Docker and the OCI runtime spec (``linux.seccomp``) both read it."""
    forbidden_ns = syscall_filter.NAMESPACE_FLAGS & ~SERVICE_NAMESPACES
    families = set(range(AF_MAX)) - set(syscall_filter.DENIED_SOCKET_FAMILIES)
    rules = [
        {"names": allowed_calls(), "action": "SCMP_ACT_ALLOW"},
        # (flags & mask) == 0: no namespace flag at all for clone, none but the service's for unshare
        _rule("clone", _arg(0, "SCMP_CMP_MASKED_EQ", syscall_filter.NAMESPACE_FLAGS, 0)),
        _rule("unshare", _arg(0, "SCMP_CMP_MASKED_EQ", forbidden_ns, 0)),
        *(_rule("setns", _arg(1, "SCMP_CMP_EQ", ns)) for ns in SERVICE_SETNS_TYPES),
        _rule("personality", _arg(0, "SCMP_CMP_EQ", syscall_filter.PERSONALITY_QUERY)),
        # (family & ~(size - 1) & LOW32) == base: the family's low 32 bits (what the kernel reads)
        *(_rule("socket", _arg(0, "SCMP_CMP_MASKED_EQ", LOW32 & ~(size - 1), base))
          for base, size in aligned_blocks(families)),
        _rule("clone3", action="SCMP_ACT_ERRNO", errno=38),  # ENOSYS
    ]
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1,  # EPERM
            "architectures": ["SCMP_ARCH_X86_64"], "syscalls": rules}


def render() -> str:
    return json.dumps(profile(), indent=1) + "\n"
