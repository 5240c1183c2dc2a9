"""Framing between the service and its zygotes: 4-byte big-endian length + msgpack map.

The request and result maps are ``RunSpec`` / ``RunOutcome`` as dicts. These are plain
dataclasses, not pydantic models, on purpose: this module is imported by the zygotes, and
every megabyte of their heap is copied on each fork. The HTTP boundary (``schemas``) is
where requests are validated; a map with an unknown or missing field fails here loudly.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

MAX_FRAME = 256 * 1024 * 1024


@dataclass
class RunSpec:
    """What one run executes, with every limit already resolved by the service."""

    code: str
    timeout_s: float
    memory_mb: int
    uid: int
    slot: int
    max_output_bytes: int
    max_processes: int
    workdir_size_mb: int
    max_fetch_file_bytes: int
    stack_bytes: int = 8 * 1024 * 1024
    stdin: bytes = b""
    files: dict[str, bytes] = field(default_factory=dict)
    fetch_files: list[str] = field(default_factory=list)  # as requested; checked one by one at fetch
    cgroup_limits: dict[str, str] = field(default_factory=dict)  # file -> kind; empty: unchanged
    cgroup_procs: list[str] = field(default_factory=list)  # join these; empty: no cgroups
    cgroup_memory_bytes: int = 0
    cpu_cores: float = 1.0  # CPU quota of the slot's cgroup
    session: bool = False  # a live interpreter that runs cells (``session_main``), not one program


@dataclass
class RunOutcome:
    ok: bool = True
    error: str = ""
    return_code: int | None = None
    timed_out: bool = False
    execution_time: float = 0.0
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: int = 0
    stderr_truncated: int = 0
    files: dict[str, bytes] = field(default_factory=dict)
    fetch_notes: dict[str, str] = field(default_factory=dict)  # requested path -> why it is absent
    # sessions only: the repr of a last-line expression, the error of the cell (Jupyter's
    # ename/evalue/traceback), why the session ended (empty while it lives), its process ids
    display: str | None = None
    figures: list[dict[str, str]] = field(default_factory=list)  # Jupyter display data of the cell's plots
    error_info: dict[str, Any] | None = None
    session_ended: str = ""
    ran: bool = True  # False: the session had ended before this cell, which did not run
    pids: list[int] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # CPU seconds per step (``phases.PHASES``)


def pack(obj: dict[str, Any] | RunSpec | RunOutcome) -> bytes:
    if not isinstance(obj, dict):
        obj = asdict(obj)
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def unpack_body(body: bytes) -> dict[str, Any]:
    return msgpack.unpackb(body, raw=False)
