"""Service-side execution: warm zygote processes, run slots, and the status mapping.

Invariants:
- at most ``max_concurrency`` runs execute at once; each holds a slot whose uid no other
  concurrent run has; at most ``max_queue`` requests wait; beyond that ``QueueFull`` is
  raised at once (the API answers 429) — a request never hangs;
- a zygote that dies is restarted; a run whose zygote fails is a ``SandboxError``, never
  a crash of the service.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import struct
import sys
import tempfile
from dataclasses import dataclass

from services.common.logging import get_logger
from services.sandbox.cgroups import CgroupPlan
from services.sandbox.config import SandboxConfig
from services.sandbox.protocol import RunOutcome, RunSpec, pack, unpack_body
from services.sandbox.routing import runs_on_light
from services.sandbox.schemas import (
    CommandRunResult,
    CommandRunStatus,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
)
from services.sandbox.user_main import RUN_ENV

log = get_logger("sandbox.executor")

# What a zygote (and so every run) may see of the environment: nothing secret.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ZYGOTE_ENV = {**RUN_ENV, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
_REPLY_GRACE_S = 15.0


class QueueFull(Exception):
    """No slot free and the wait queue is at ``max_queue``."""


class QueueTimeout(Exception):
    """Waited ``queue_timeout_s`` for a slot."""


class Zygote:
    def __init__(self, name: str, sock_dir: str, preload: list[str], writable: list[str],
                 slots: list[int]) -> None:
        self.name = name
        self.writable = writable
        self.slots = slots
        self.sock_path = os.path.join(sock_dir, f"zygote-{name}.sock")
        self.preload = preload
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, timeout_s: float = 120.0) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock_path)
        env = {**_ZYGOTE_ENV, "PYTHONPATH": _PACKAGE_ROOT}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.sandbox.zygote", "--socket", self.sock_path,
            "--preload", ",".join(self.preload), "--writable", ",".join(self.writable),
            "--netns-slots", ",".join(map(str, self.slots)), env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, cwd="/")
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if line.strip() != b"READY":
            raise RuntimeError(f"zygote {self.name} failed to start (exit code {self.proc.returncode})")

    async def stop(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            await self.proc.wait()

    async def run(self, spec: RunSpec) -> RunOutcome:
        reader, writer = await asyncio.open_unix_connection(self.sock_path)
        try:
            writer.write(pack(spec))
            await writer.drain()
            async with asyncio.timeout(spec.timeout_s + _REPLY_GRACE_S):
                (length,) = struct.unpack(">I", await reader.readexactly(4))
                body = await reader.readexactly(length)
            return RunOutcome(**unpack_body(body))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@dataclass
class ExecStats:
    in_flight: int = 0
    queued: int = 0


class Executor:
    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self._sock_dir = tempfile.mkdtemp(prefix="retool-sandbox-")
        os.chmod(self._sock_dir, 0o700)
        self.cgroups = CgroupPlan.detect(f"retool-sandbox-{os.getpid()}") if cfg.use_cgroups else None
        if cfg.use_cgroups and self.cgroups is None:
            log.warning("cgroups unavailable: memory and process limits apply per process only")
        self._slot_limits: dict[int, tuple[int, int]] = {}  # limits last written per slot cgroup
        self._slot_cgroups = ([self.cgroups.slot(i) for i in range(cfg.max_concurrency)]
                              if self.cgroups else [])
        writable = sorted(self.cgroups.mount_points()) if self.cgroups else []
        def slots_of(index: int, pool_size: int) -> list[int]:  # run slot s goes to zygote s % pool_size
            return list(range(index, cfg.max_concurrency, pool_size))

        self.full = [Zygote(f"full-{i}", self._sock_dir, cfg.preload_modules, writable,
                            slots_of(i, cfg.zygotes)) for i in range(cfg.zygotes)]
        self.light = [Zygote(f"light-{i}", self._sock_dir, cfg.light_preload_modules, writable,
                             slots_of(i, cfg.light_zygotes)) for i in range(cfg.light_zygotes)]
        self.zygotes = self.full + self.light
        self._light_modules = frozenset(cfg.light_preload_modules)
        self._slots: asyncio.Queue[int] = asyncio.Queue()
        self.stats = ExecStats()
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for slot in range(self.cfg.max_concurrency):
            self._slots.put_nowait(slot)
        await asyncio.gather(*(z.start() for z in self.zygotes))
        self._watchdog = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await asyncio.gather(*(z.stop() for z in self.zygotes))
        if self.cgroups is not None:
            self.cgroups.remove()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._sock_dir):
                os.unlink(os.path.join(self._sock_dir, name))
            os.rmdir(self._sock_dir)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for z in self.zygotes:
                if not z.alive:
                    log.warning("zygote died; restarting", extra={"zygote": z.name})
                    z.restarts += 1
                    with contextlib.suppress(Exception):
                        await z.start()

    @property
    def healthy_zygotes(self) -> int:
        return sum(z.alive for z in self.zygotes)

    async def _acquire_slot(self) -> int:
        with contextlib.suppress(asyncio.QueueEmpty):
            return self._slots.get_nowait()
        if self.stats.queued >= self.cfg.max_queue:
            raise QueueFull(f"sandbox busy: {self.cfg.max_concurrency} runs in flight and "
                            f"{self.stats.queued} queued (max_queue={self.cfg.max_queue})")
        self.stats.queued += 1
        try:
            return await asyncio.wait_for(self._slots.get(), self.cfg.queue_timeout_s)
        except TimeoutError:
            raise QueueTimeout(
                f"no execution slot within queue_timeout_s={self.cfg.queue_timeout_s}") from None
        finally:
            self.stats.queued -= 1

    def spec_for(self, req: RunCodeRequest, slot: int) -> RunSpec:
        cfg = self.cfg
        memory = req.memory_limit_MB if req.memory_limit_MB > 0 else cfg.default_memory_mb
        cg = self._slot_cgroups[slot] if self._slot_cgroups else None
        # the whole run: its memory limit, its tmpfs, and pages it copies from the zygote
        limits = ((memory + cfg.workdir_size_mb + cfg.cgroup_slack_mb) * 2**20, cfg.max_processes)
        write = cg is not None and self._slot_limits.get(slot) != limits
        if write:
            self._slot_limits[slot] = limits
        return RunSpec(cgroup_limits=cg.limits if write and cg else {}, cgroup_procs=cg.procs if cg else [],
                       cgroup_memory_bytes=limits[0], code=req.code, stdin=(req.stdin or "").encode(),
                       files=req.decoded_files(),
                       fetch_files=req.fetch_files, timeout_s=req.run_timeout or cfg.default_run_timeout_s,
                       memory_mb=memory, uid=cfg.uid_base + slot, slot=slot,
                       max_output_bytes=cfg.max_output_bytes,
                       max_processes=cfg.max_processes, workdir_size_mb=cfg.workdir_size_mb,
                       max_fetch_file_bytes=cfg.max_fetch_file_bytes)

    async def run(self, req: RunCodeRequest) -> RunCodeResponse:
        slot = await self._acquire_slot()
        self.stats.in_flight += 1
        try:
            spec = self.spec_for(req, slot)
            pool = self.light if self.light and runs_on_light(req.code, self._light_modules) else self.full
            zygote = pool[slot % len(pool)]
            if not zygote.alive:  # being restarted: any live zygote gives the same result
                zygote = next((z for z in self.zygotes if z.alive), zygote)
            try:
                outcome = await zygote.run(spec)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, TypeError) as exc:
                outcome = RunOutcome(ok=False, error=f"executor unavailable: {type(exc).__name__}: {exc}")
            if not outcome.ok:
                self._slot_limits.pop(slot, None)  # unknown state: write the limits again next time
            return to_response(outcome)
        finally:
            self.stats.in_flight -= 1
            self._slots.put_nowait(slot)


def to_response(outcome: RunOutcome) -> RunCodeResponse:
    """SandboxFusion's mapping: exit 0 -> Success; non-zero or timeout -> Failed; ours -> SandboxError."""
    if not outcome.ok:
        return RunCodeResponse(status=RunStatus.SandboxError, message=outcome.error)
    stdout = outcome.stdout.decode("utf-8", errors="replace")
    stderr = outcome.stderr.decode("utf-8", errors="replace")
    files = {p: base64.b64encode(d).decode() for p, d in outcome.files.items()}
    if outcome.timed_out:
        result = CommandRunResult(status=CommandRunStatus.TimeLimitExceeded,
                                  execution_time=outcome.execution_time, return_code=None,
                                  stdout=stdout, stderr=stderr)
        return RunCodeResponse(status=RunStatus.Failed, message="", run_result=result, files=files)
    result = CommandRunResult(status=CommandRunStatus.Finished, execution_time=outcome.execution_time,
                              return_code=outcome.return_code, stdout=stdout, stderr=stderr)
    status = RunStatus.Success if outcome.return_code == 0 else RunStatus.Failed
    return RunCodeResponse(status=status, message="", run_result=result, files=files)
