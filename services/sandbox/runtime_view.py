"""Make the Python runtime readable to unprivileged runs without opening anything else.

A Python installed under a private directory (e.g. ``/root/.pyenv``, mode 0700) cannot be
read once a run drops to its own uid, so ``import csv`` would fail. In the zygote's own
mount namespace, every such private ancestor is covered by an empty tmpfs into which only
the subtrees holding the runtime (prefixes, ``sys.path`` entries, this package) are
bind-mounted back. Invariant: nothing else under the private ancestor is visible to runs,
and the host's mounts are untouched (the namespace is private).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import defaultdict

from services.sandbox import linux


def runtime_paths(package_root: str) -> list[str]:
    candidates = {sys.base_prefix, sys.prefix, package_root, *sys.path}
    return sorted({os.path.realpath(p) for p in candidates if p and os.path.isdir(p)})


def _hidden_ancestor(path: str) -> tuple[str, str] | None:
    """Top-most ancestor not traversable by others, and its child on the way to ``path``."""
    parts = path.strip("/").split("/")
    current = "/"
    for part in parts:
        parent, current = current, os.path.join(current, part)
        if parent != "/" and not os.stat(parent).st_mode & 0o001:
            return parent, current
    return None


def expose_runtime(paths: list[str]) -> list[str]:
    """Enter a private mount namespace and re-expose ``paths`` hidden by private ancestors.

    Returns the private ancestors that were covered.
    """
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    groups: dict[str, set[str]] = defaultdict(set)
    for path in paths:
        hit = _hidden_ancestor(path)
        if hit is not None:
            groups[hit[0]].add(hit[1])
    for ancestor, children in groups.items():
        stage = tempfile.mkdtemp(prefix="retool-stage-")
        staged = []
        for i, child in enumerate(sorted(children)):
            slot = os.path.join(stage, str(i))
            os.mkdir(slot)
            linux.mount(child, slot, None, linux.MS_BIND | linux.MS_REC)
            staged.append((slot, child))
        linux.mount("tmpfs", ancestor, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=1m,mode=0755")
        for slot, child in staged:
            os.mkdir(child, 0o755)
            linux.mount(slot, child, None, linux.MS_MOVE)
            os.rmdir(slot)
        os.rmdir(stage)
    return sorted(groups)


def remount_readonly(keep_writable: frozenset[str] = frozenset()) -> None:
    """Make every mount of the current (private) mount namespace read-only, but ``keep_writable``."""
    for target, opts in linux.mount_points():
        if target in keep_writable:
            continue
        flags = linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY
        for name, bit in (("nosuid", linux.MS_NOSUID), ("nodev", linux.MS_NODEV),
                          ("noexec", linux.MS_NOEXEC)):
            if name in opts:
                flags |= bit
        try:
            linux.mount(None, target, None, flags)
        except OSError:
            if target == "/":
                raise  # fail closed: a writable root is not a sandbox
