"""Service-side execution: zygote pools, run slots, admission, and the status mapping.

Invariants:
- at most ``max_concurrency`` runs execute at once; each holds a slot whose uid no other
  concurrent run has;
- a request waits for a slot at most ``limits.queue_wait_s`` and at most ``max_queue``
  requests wait; beyond either, ``QueueFull``/``QueueTimeout`` (the API answers 504, the
  one status verl's client retries) — a request never hangs;
- a zygote that dies is restarted; its runs die with it and answer ``SandboxError``, never
  a crash of the service; what it leaves behind comes to the service (a child subreaper,
  or pid 1 in a container) and is killed and reaped;
- fail closed: under ``isolation: strict`` the executor does not start unless the memory,
  pids and CPU cgroups are usable and every zygote holds its filter, root and empty bounding
  set; under ``degraded`` what is missing is listed in ``gaps`` and every answer says so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from services.common.config import ConfigError
from services.common.logging import get_logger
from services.sandbox import linux, syscall_filter
from services.sandbox.capture import decode_output
from services.sandbox.cgroups import CgroupPlan, SlotCgroup
from services.sandbox.config import SandboxConfig
from services.sandbox.limits import RunLimits, queue_wait_s, resolve_limits
from services.sandbox.protocol import RunOutcome, RunSpec
from services.sandbox.routing import choose_pool, top_level
from services.sandbox.runtime_env import resolve_runtime_python, stage_package
from services.sandbox.zygote_process import Zygote, ZygoteSetup
from services.transport.sandbox.schemas import (
    CommandRunResult,
    CommandRunStatus,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
)

log = get_logger("sandbox.executor")
POD_NAME = os.environ.get("MY_POD_NAME")  # reported as executor_pod_name, as SandboxFusion does


class QueueFull(Exception):
    """No slot free and the wait queue is at ``max_queue``."""


class QueueTimeout(Exception):
    """Waited as long as the request may for a slot."""


@dataclass
class ExecStats:
    in_flight: int = 0
    queued: int = 0


@dataclass
class Pool:
    name: str
    warm: frozenset[str]  # top-level modules preloaded by its zygotes
    zygotes: list[Zygote]


CGROUP_HELP = ("give the service a writable cgroup tree with the memory, pids and cpu controllers (host: "
               "cgroup v1 hierarchies, or v2 with the three delegated; container: compose `cgroup: private` "
               "and CAP_SYS_ADMIN), or set isolation: degraded to run without them")


class Executor:
    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.runtime_python = resolve_runtime_python(cfg.runtime_python)
        self.cgroups = CgroupPlan.detect(f"retool-sandbox-{os.getpid()}") if cfg.use_cgroups else None
        self.gaps = self._cgroup_gaps()
        if self.gaps and cfg.isolation == "strict":
            if self.cgroups is not None:
                self.cgroups.remove()
            gaps = '; '.join(self.gaps)
            raise ConfigError(f"the sandbox cannot enforce its limits ({gaps}): {CGROUP_HELP}")
        for gap in self.gaps:
            log.error("isolation degraded: %s", gap)
        self._sock_dir = tempfile.mkdtemp(prefix="retool-sandbox-")
        os.chmod(self._sock_dir, 0o700)
        self._stage = stage_package()
        seccomp_bpf = self._export_filter()
        self._slot_limits: dict[int, tuple[int, int, float]] = {}  # limits last written per slot cgroup
        self._slot_cgroups = ([self.cgroups.slot(i) for i in range(cfg.max_concurrency)]
                              if self.cgroups else [])
        # called with each stateless run's CPU seconds per step (``phases.PHASES``): the metrics
        self.on_phases: Callable[[dict[str, float]], None] = lambda phases: None
        setup = ZygoteSetup(python=self.runtime_python, package_stage=self._stage, sock_dir=self._sock_dir,
                            cgroup_parents=self.cgroups.parents() if self.cgroups else [],
                            slot_count=cfg.max_concurrency + cfg.max_sessions, uid_base=cfg.uid_base,
                            stack_mb=cfg.max_stack_mb, isolation=cfg.isolation, seccomp_bpf=seccomp_bpf)

        def pool(name: str, preload: list[str], count: int) -> Pool:
            zygotes = [Zygote(f"{name}-{i}", setup, preload=preload,
                              slots=list(range(i, cfg.max_concurrency, count)))
                       for i in range(count)]  # run slot s goes to zygote s % count
            return Pool(name, top_level(preload), zygotes)

        candidates = [pool("light", cfg.light_preload_modules, cfg.light_zygotes),
                      pool("full", cfg.preload_modules, cfg.zygotes),
                      pool("heavy", cfg.heavy_preload_modules, cfg.heavy_zygotes)]
        self.pools = [p for p in candidates if p.zygotes]  # cheapest first; "full" always exists
        self.zygotes = [z for p in self.pools for z in p.zygotes]
        self._default_pool = next(i for i, p in enumerate(self.pools) if p.name == "full")
        self._slots: asyncio.Queue[int] = asyncio.Queue()
        self.stats = ExecStats()
        self._watchdog: asyncio.Task[None] | None = None

    def _export_filter(self) -> str:
        """The runs' syscall filter as a file for the zygotes; "" (a gap they report) if not built."""
        path = os.path.join(self._sock_dir, "filter.bpf")
        try:
            bpf = syscall_filter.export(self.runtime_python, self._stage)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            log.error("cannot build the runs' syscall filter with %s: %s (pyseccomp and libseccomp.so.2 "
                      "are needed in the runs' runtime)", self.runtime_python, exc)
            return ""
        with open(path, "wb") as fh:
            fh.write(bpf)
        return path

    def _cgroup_gaps(self) -> list[str]:
        if not self.cfg.use_cgroups:
            return ["no per-run cgroups (use_cgroups=false): memory and process limits per process only, "
                    "no CPU limit"]
        if self.cgroups is None:
            return ["no per-run memory/pids/cpu cgroups (no writable cgroup tree)"]
        return [f"no per-run {kind} cgroup (controller unavailable)" for kind in self.cgroups.missing]

    @property
    def degraded(self) -> bool:
        return bool(self.gaps)

    def isolation_note(self) -> tuple[str, ...]:
        """The note every answer carries under degraded isolation (empty otherwise)."""
        return (f"isolation degraded: {'; '.join(self.gaps)}",) if self.gaps else ()

    async def start(self) -> None:
        _check_stack_limit(self.cfg.max_stack_mb)
        try:
            linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)  # a dead zygote's leftovers come to us
        except OSError as exc:  # gVisor before 2023: leftovers go to pid 1 and end on their own timers
            log.warning("cannot become a child subreaper (%s): a dead zygote's leftovers are reaped "
                        "by pid 1 and end on their own timers", exc)
        for slot in range(self.cfg.max_concurrency):
            self._slots.put_nowait(slot)
        try:
            await asyncio.gather(*(z.start() for z in self.zygotes))
        except BaseException:
            await self.stop()
            raise
        for gap in sorted({str(g) for z in self.zygotes for g in z.info.get("isolation_gaps", [])}):  # type: ignore[attr-defined]
            log.error("isolation degraded: %s", gap)
            self.gaps.append(gap)
        for z in self.zygotes:
            if z.info.get("preload_failed"):
                log.warning("zygote could not preload modules", extra={
                    "zygote": z.name, "modules": z.info["preload_failed"], "python": z.info.get("python")})
        self._watchdog = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await asyncio.gather(*(z.stop() for z in self.zygotes))
        if self.cgroups is not None:
            self.cgroups.remove()
        shutil.rmtree(self._sock_dir, ignore_errors=True)
        shutil.rmtree(self._stage, ignore_errors=True)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            clean_orphans({z.pid for z in self.zygotes if z.pid is not None})
            for z in self.zygotes:
                if not z.alive:
                    log.warning("zygote died; restarting", extra={"zygote": z.name})
                    z.restarts += 1
                    with contextlib.suppress(Exception):
                        await z.start()

    def session_zygotes(self) -> list[Zygote]:
        """The zygotes that hold sessions: the last pool's, with the most modules warm (a session is
        forked once and lives long, so the dearer fork does not matter; matplotlib is warm there)."""
        return self.pools[-1].zygotes

    def session_cgroup(self, index: int) -> SlotCgroup | None:
        """The cgroup of slot ``index`` (a session's slot lies after the run slots), or None."""
        return self.cgroups.slot(index) if self.cgroups else None

    @property
    def healthy_zygotes(self) -> int:
        return sum(z.alive for z in self.zygotes)

    def runtime_info(self) -> dict[str, object]:
        failed = sorted({str(m) for z in self.zygotes for m in z.info.get("preload_failed", [])})  # type: ignore[attr-defined]
        root = sorted({str(p) for z in self.zygotes for p in z.info.get("root", [])})  # type: ignore[attr-defined]
        return {"python": self.runtime_python, "preload_failed": failed,
                "pools": {p.name: len(p.zygotes) for p in self.pools}, "host_paths_in_root": root}

    async def _acquire_slot(self, wait_s: float) -> int:
        with contextlib.suppress(asyncio.QueueEmpty):
            return self._slots.get_nowait()
        if self.stats.queued >= self.cfg.max_queue:
            raise QueueFull(f"sandbox busy: {self.cfg.max_concurrency} runs in flight and "
                            f"{self.stats.queued} queued (max_queue={self.cfg.max_queue}); retry later")
        self.stats.queued += 1
        try:
            return await asyncio.wait_for(self._slots.get(), wait_s)
        except TimeoutError:
            raise QueueTimeout(f"sandbox busy: no execution slot within {wait_s:g} s; retry later") from None
        finally:
            self.stats.queued -= 1

    def spec_for(self, req: RunCodeRequest, limits: RunLimits, slot: int) -> RunSpec:
        cfg = self.cfg
        cg = self._slot_cgroups[slot] if self._slot_cgroups else None
        # the whole run: its memory limit, its tmpfs, and pages it copies from the zygote
        run_mb = limits.memory_mb + cfg.workdir_size_mb + cfg.cgroup_slack_mb
        cg_limits = (run_mb * 2**20, cfg.max_processes, limits.cpu_cores)
        write = cg is not None and self._slot_limits.get(slot) != cg_limits
        if write:
            self._slot_limits[slot] = cg_limits
        return RunSpec(cgroup_limits=cg.limits if write and cg else {}, cgroup_procs=cg.procs if cg else [],
                       cgroup_memory_bytes=cg_limits[0], cpu_cores=limits.cpu_cores, code=req.code,
                       stdin=(req.stdin or "").encode(),
                       files=req.decoded_files(), fetch_files=list(req.fetch_files),
                       timeout_s=limits.timeout_s, memory_mb=limits.memory_mb,
                       stack_bytes=limits.stack_mb * 2**20, uid=cfg.uid_base + slot, slot=slot,
                       max_output_bytes=cfg.max_output_bytes, max_processes=cfg.max_processes,
                       workdir_size_mb=cfg.workdir_size_mb, max_fetch_file_bytes=cfg.max_fetch_file_bytes)

    async def run(self, req: RunCodeRequest) -> RunCodeResponse:
        limits = resolve_limits(req, self.cfg)
        slot = await self._acquire_slot(queue_wait_s(req, self.cfg))
        self.stats.in_flight += 1
        try:
            spec = self.spec_for(req, limits, slot)
            chosen = choose_pool(req.code, [p.warm for p in self.pools], self._default_pool)
            pool = self.pools[chosen].zygotes
            zygote = pool[slot % len(pool)]
            if not zygote.alive:  # being restarted: any live zygote gives the same result
                zygote = next((z for z in self.zygotes if z.alive), zygote)
            try:
                outcome = await zygote.run(spec)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, TypeError) as exc:
                outcome = RunOutcome(ok=False, error=f"executor unavailable: {type(exc).__name__}: {exc}")
            if not outcome.ok:
                self._slot_limits.pop(slot, None)  # unknown state: write the limits again next time
            if outcome.phases:
                self.on_phases(outcome.phases)
            return to_response(outcome, (*self.isolation_note(), *limits.notes))
        finally:
            self.stats.in_flight -= 1
            self._slots.put_nowait(slot)


def _check_stack_limit(stack_mb: int) -> None:
    """Zygotes raise their stack limit for the largest run stack (zygote.py), up to the hard limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    want = stack_mb * 2**20
    if hard != resource.RLIM_INFINITY and hard < want:
        log.warning("RLIMIT_STACK hard limit is below the largest run stack; deep recursion is "
                    "capped there", extra={"hard_bytes": hard, "wanted_bytes": want})


def clean_orphans(keep: set[int]) -> int:
    """Kill and reap every child that is not ``keep`` (the zygotes asyncio waits for).

    Any other child is something a dead zygote left behind: the ``sleep`` holding a run's
    pid namespace (the run's own processes stay in that namespace, with it as their
    reaper), handed to us as the subreaper (or as pid 1 in a container). Returns how many
    were reaped.
    """
    reaped = 0
    for child in _children() - keep:
        try:
            with open(f"/proc/{child}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)  # a run's init (root): its whole namespace ends
            continue
        with contextlib.suppress(ChildProcessError):
            reaped += os.waitpid(child, os.WNOHANG)[0] == child
    return reaped


def _children() -> set[int]:
    pids: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as fh:
                pids.update(int(p) for p in fh.read().split())
    return pids


def to_response(outcome: RunOutcome, notes: tuple[str, ...] = ()) -> RunCodeResponse:
    """SandboxFusion's mapping: exit 0 -> Success; non-zero, signal or timeout -> Failed;
    ours -> SandboxError. ``message`` carries what was adjusted or skipped (else empty)."""
    skipped = (f"fetch_files {path!r} skipped: {why}" for path, why in outcome.fetch_notes.items())
    messages = [*notes, *skipped]
    if not outcome.ok:
        return RunCodeResponse(status=RunStatus.SandboxError, message="; ".join([outcome.error, *messages]),
                               executor_pod_name=POD_NAME)
    files = {p: base64.b64encode(d).decode() for p, d in outcome.files.items()}
    result = CommandRunResult(
        status=CommandRunStatus.TimeLimitExceeded if outcome.timed_out else CommandRunStatus.Finished,
        execution_time=outcome.execution_time, return_code=None if outcome.timed_out else outcome.return_code,
        stdout=decode_output(outcome.stdout), stderr=decode_output(outcome.stderr))
    status = RunStatus.Success if not outcome.timed_out and outcome.return_code == 0 else RunStatus.Failed
    return RunCodeResponse(status=status, message="; ".join(messages), run_result=result, files=files,
                           executor_pod_name=POD_NAME)
