"""Files other users must read: model directories served and trained in containers.

Invariant: after :func:`make_world_readable`, every file under the directory is readable and
every directory searchable by any uid, whatever the writer's umask was. The services'
containers run as uid 10001 (deploy/docker/Dockerfile) and read host-written models through
a bind mount, so a model written 0600 by root (umask 077) would be unreadable there.
Nothing is made writable: only read (files) and read+search (directories) bits are added.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def make_world_readable(root: str | Path) -> Path:
    """Add ``a+r`` to every file and ``a+rx`` to every directory under ``root`` (and itself)."""
    root = Path(root)

    def add(path: str, bits: int) -> None:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        if mode & bits != bits:
            os.chmod(path, mode | bits)

    add(str(root), 0o555)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            add(os.path.join(dirpath, name), 0o555)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                add(path, 0o444)
    return root
