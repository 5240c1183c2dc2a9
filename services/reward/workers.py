"""A pool of worker processes for the symbolic path; the time limit bounds work, never waiting.

Invariants:
- a check's limit starts when a worker starts on it, never while it waits for a free
  worker: ``timeout_s`` is the *CPU time* the worker may spend on that one check (read from
  ``/proc/<pid>/stat``, so a loaded machine does not turn a correct answer into a timeout),
  with a wall-clock backstop of ``WALL_FACTOR × timeout_s`` for a worker that cannot run at
  all. A worker past either limit is SIGKILLed and replaced in the background, so the pool
  never shrinks for good and a hung sympy call never stalls a caller;
- waiting is bounded by admission, not by a clock: ``admit(n)`` refuses new checks while
  ``max_queue`` are already admitted and unfinished (the service answers 503 with
  ``Retry-After``); an admitted check always runs to a verdict or to its work limit;
- identical checks in flight at the same time share one worker request.
Workers are plain subprocesses (``python -m services.reward.symbolic_worker``) speaking one
JSON line per request and per answer on stdin/stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
WALL_FACTOR = 10.0  # wall-clock backstop: a worker starved this long is treated as hung
_MIN_WAIT_S = 0.01


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (Linux ``/proc``), or None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (fields 14, 15)


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls) -> _Worker:
        env = {**os.environ, "PYTHONPATH": _PACKAGE_ROOT, "OMP_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.reward.symbolic_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=2**20,
        )
        worker = cls(proc)
        assert proc.stdout is not None
        ready = await proc.stdout.readline()
        if ready.strip() != b"ready":
            raise RuntimeError("symbolic worker failed to start")
        return worker

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def cpu_seconds(self) -> float | None:
        return cpu_seconds(self.proc.pid)

    async def send(self, request: object) -> bool:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise EOFError("worker exited")
        return bool(json.loads(line))

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 5)


@dataclass
class PoolStats:
    """Counters the service exports; all monotonic except ``admitted``."""

    timeouts: int = 0  # checks stopped at the work limit (CPU) or the wall backstop
    wall_timeouts: int = 0  # of which at the wall backstop (a starved, not a busy, worker)
    checks: int = 0  # checks that reached a worker
    work_seconds: float = 0.0  # wall seconds workers spent on checks (for Retry-After)
    cpu_seconds: float = 0.0  # CPU seconds workers spent on checks (what the limit counts)
    wait_seconds: float = 0.0  # seconds checks waited for a free worker


class SymbolicPool:
    def __init__(self, size: int, timeout_s: float, max_queue: int = 4096) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self.wall_limit_s = WALL_FACTOR * timeout_s
        self.max_queue = max_queue
        self.stats = PoolStats()
        self.admitted = 0  # checks admitted and not finished (waiting or running)
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._respawns: set[asyncio.Task[None]] = set()
        self._inflight: dict[tuple[str, str], asyncio.Task[bool | None]] = {}
        self._stopped = False

    async def start(self) -> None:
        for worker in await asyncio.gather(*(_Worker.spawn() for _ in range(self.size))):
            self._all.add(worker)
            self._idle.put_nowait(worker)

    async def stop(self) -> None:
        self._stopped = True
        for task in [*self._inflight.values(), *self._respawns]:
            task.cancel()
        await asyncio.gather(*(w.kill() for w in self._all))
        self._all.clear()

    @property
    def alive(self) -> int:
        return sum(w.alive for w in self._all)

    @property
    def idle(self) -> int:
        return self._idle.qsize()

    @property
    def timeouts(self) -> int:
        return self.stats.timeouts

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more checks fit under ``max_queue`` (an empty pool takes any batch)."""
        return self.admitted == 0 or self.admitted + n <= self.max_queue

    def retry_after_s(self) -> int:
        """Seconds until the admitted checks should be done, from the mean work time so far."""
        mean = self.stats.work_seconds / self.stats.checks if self.stats.checks else 0.05
        return max(1, min(60, math.ceil(self.admitted * mean / max(1, self.size))))

    async def check(self, pred: str, truth: str) -> bool | None:
        """True/False, or None when the check ran past its work limit (and was killed).

        Waits for a free worker as long as it takes; the limit starts with the work. The
        request runs in its own task, so a cancelled caller can never leave a worker
        half-way through an answer.
        """
        key = (pred, truth)
        task = self._inflight.get(key)
        if task is None:
            self.admitted += 1
            task = asyncio.create_task(self._check(pred, truth))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._done(key))
        return await asyncio.shield(task)

    def _done(self, key: tuple[str, str]) -> None:
        self._inflight.pop(key, None)
        self.admitted -= 1

    async def _check(self, pred: str, truth: str) -> bool | None:
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        worker = await self._idle.get()
        started = loop.time()
        self.stats.wait_seconds += started - queued_at
        self.stats.checks += 1
        try:
            result = await self._run(worker, pred, truth)
        except (EOFError, OSError, ValueError):
            result = None  # the worker died on this input: same outcome as a hang
        finally:
            self.stats.work_seconds += loop.time() - started
        if result is None:
            self.stats.timeouts += 1
            self._retire(worker)
            return None
        self._idle.put_nowait(worker)
        return result

    async def _run(self, worker: _Worker, pred: str, truth: str) -> bool | None:
        """The worker's answer, or None once it used ``timeout_s`` of CPU on this check.

        It is waited for in slices no longer than the CPU budget left (CPU time cannot
        grow faster than wall time), so a fast answer costs no polling at all.
        """
        loop = asyncio.get_running_loop()
        cpu0 = worker.cpu_seconds()
        wall0 = loop.time()
        answer = asyncio.ensure_future(worker.send([pred, truth]))
        used = 0.0
        try:
            while True:
                wall_left = self.wall_limit_s - (loop.time() - wall0)
                cpu = worker.cpu_seconds()
                # without /proc the limit falls back to wall time
                used = loop.time() - wall0 if cpu is None or cpu0 is None else cpu - cpu0
                cpu_left = self.timeout_s - used
                if cpu_left <= 0 or wall_left <= 0:
                    if wall_left <= 0 and cpu_left > 0:
                        self.stats.wall_timeouts += 1
                    return None
                done, _ = await asyncio.wait({answer}, timeout=max(min(cpu_left, wall_left), _MIN_WAIT_S))
                if done:
                    return answer.result()
        finally:
            self.stats.cpu_seconds += used
            if not answer.done():
                answer.cancel()

    def _retire(self, worker: _Worker) -> None:
        """Kill a worker now (not in a task that may be cancelled) and start its replacement."""
        self._all.discard(worker)
        with contextlib.suppress(ProcessLookupError):
            worker.proc.kill()
        if not self._stopped:
            task = asyncio.create_task(self._replace(worker))
            self._respawns.add(task)
            task.add_done_callback(self._respawns.discard)

    async def clear_caches(self) -> None:
        """Empty every worker's parse cache (for benchmarks); waits for each to be idle."""
        workers = [await self._idle.get() for _ in range(len(self._all))]
        try:
            await asyncio.gather(*(w.send("clear") for w in workers))
        finally:
            for w in workers:
                self._idle.put_nowait(w)

    async def _replace(self, worker: _Worker) -> None:
        await worker.kill()
        while True:
            try:
                fresh = await _Worker.spawn()
                break
            except (OSError, RuntimeError):
                await asyncio.sleep(1.0)
        self._all.add(fresh)
        self._idle.put_nowait(fresh)
