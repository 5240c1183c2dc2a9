"""The service's handle on one zygote process: start it, send it runs, stop it.

Invariant: a zygote is started on the runs' interpreter with a scrubbed environment (no
secret of the service reaches it), knows the service's pid (so it can tell when the service
is gone, even when the service is pid 1), and reports what it could not preload and which
isolation layer it lacks; one that refuses to start (``FAILED``) raises ``ZygoteRefused``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from typing import Any

from services.sandbox.protocol import RunOutcome, RunSpec, pack, unpack_body
from services.sandbox.user_main import RUN_ENV

# What a zygote (and so every run) may see of the environment: nothing secret.
_ZYGOTE_ENV = {**RUN_ENV, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
_REPLY_GRACE_S = 15.0


class ZygoteRefused(RuntimeError):
    """The zygote cannot enforce an isolation layer that ``isolation: strict`` requires."""


@dataclass(frozen=True)
class ZygoteSetup:
    """What every zygote of a service shares: where it lives and what it must enforce."""

    python: str
    package_stage: str
    sock_dir: str
    cgroup_parents: list[str]
    slot_count: int  # slot indices (runs, then sessions) a zygote may serve
    uid_base: int
    stack_mb: int
    isolation: str
    seccomp_bpf: str  # path of the exported filter program; empty: none (a gap)


class Zygote:
    def __init__(self, name: str, setup: ZygoteSetup, *, preload: list[str], slots: list[int]) -> None:
        self.name = name
        self.setup = setup
        self.python = setup.python
        self.slots = slots
        self.sock_path = os.path.join(setup.sock_dir, f"zygote-{name}.sock")
        self.root = os.path.join(setup.sock_dir, f"root-{name}")
        self.preload = preload
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.ready = False  # it reported READY (its socket listens) since it was last started
        self.info: dict[str, object] = {}  # what the zygote reported when it became ready

    @property
    def alive(self) -> bool:
        """Running and ready: a zygote being (re)started is not alive until it reports READY, so
        /healthz and the dispatch never count or pick one whose socket does not listen yet."""
        return self.ready and self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self, timeout_s: float = 180.0) -> None:
        self.ready = False
        if self.proc is not None and self.proc.returncode is None:  # a start that never got ready
            self.proc.kill()
            await self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock_path)
        s = self.setup
        # matplotlib's font cache, built while preloading (before the zygote enters its root)
        env = {**_ZYGOTE_ENV, "PYTHONPATH": s.package_stage, "MPLCONFIGDIR": f"{self.root}-mpl"}
        self.proc = await asyncio.create_subprocess_exec(
            self.python, "-s", "-m", "services.sandbox.zygote", "--socket", self.sock_path,
            "--parent-pid", str(os.getpid()), "--root", self.root, "--stack-mb", str(s.stack_mb),
            "--preload", ",".join(self.preload), "--cgroup-parents", ",".join(s.cgroup_parents),
            "--netns-slots", ",".join(map(str, self.slots)), "--slot-count", str(s.slot_count),
            "--uid-base", str(s.uid_base), "--uid-count", str(s.slot_count), "--isolation", s.isolation,
            "--seccomp-bpf", s.seccomp_bpf,
            env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, cwd="/")
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if line.startswith(b"FAILED"):
            await self.proc.wait()
            gaps = json.loads(line[len(b"FAILED"):])["gaps"]
            raise ZygoteRefused(f"zygote {self.name} cannot enforce the runs' isolation: {'; '.join(gaps)}")
        if not line.startswith(b"READY"):
            raise RuntimeError(f"zygote {self.name} failed to start (exit code {self.proc.returncode})")
        self.info = json.loads(line[len(b"READY"):] or b"{}")
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc is not None
            self.proc.kill()
            await self.proc.wait()

    async def run(self, spec: RunSpec) -> RunOutcome:
        return await self.call(asdict(spec), spec.timeout_s)

    async def call(self, msg: dict[str, Any], timeout_s: float) -> RunOutcome:
        """Send one request (a run, or a session operation: see ``zygote._dispatch``); its outcome."""
        reader, writer = await asyncio.open_unix_connection(self.sock_path)
        try:
            writer.write(pack(msg))
            await writer.drain()
            async with asyncio.timeout(timeout_s + _REPLY_GRACE_S):
                (length,) = struct.unpack(">I", await reader.readexactly(4))
                body = await reader.readexactly(length)
            return RunOutcome(**unpack_body(body))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
