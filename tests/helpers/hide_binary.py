"""A PATH on which one program cannot be found, for tests of what a machine without it does.

Invariants: every other program on the original PATH is still found, under the same name and
in the same order (directories holding the hidden program are replaced by a directory of symlinks
to their other entries); nothing outside ``workdir`` is changed.
"""

from __future__ import annotations

import os
from pathlib import Path


def path_without(program: str, workdir: Path, path: str | None = None) -> str:
    """``path`` (default: $PATH) with ``program`` hidden."""
    out = []
    for i, entry in enumerate((path if path is not None else os.environ.get("PATH", "")).split(os.pathsep)):
        d = Path(entry)
        if not (d / program).exists():
            out.append(entry)
            continue
        links = workdir / f"path-{i}"
        links.mkdir(parents=True, exist_ok=True)
        for item in d.iterdir():
            if item.name != program and not (links / item.name).exists():
                (links / item.name).symlink_to(item)
        out.append(str(links))
    return os.pathsep.join(out)
