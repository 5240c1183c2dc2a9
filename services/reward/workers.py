"""A pool of worker processes for the symbolic path, each killable at its deadline.

Invariant: a check returns within ``timeout_s`` of being asked, waiting for a free worker
included; otherwise the answer is ``None`` (timeout) and a worker still busy with it is
SIGKILLed; a replacement starts in the background, so the pool
never shrinks for good and a hung sympy call can never stall the caller. Workers are
plain subprocesses (``python -m services.reward.symbolic_worker``) speaking one JSON line
per request and per answer on stdin/stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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

    async def ask(self, pred: str, truth: str) -> bool:
        return await self.send([pred, truth])

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


class SymbolicPool:
    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._respawns: set[asyncio.Task[None]] = set()
        self._inflight: dict[tuple[str, str], asyncio.Task[bool | None]] = {}
        self._stopped = False
        self.timeouts = 0

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

    async def check(self, pred: str, truth: str) -> bool | None:
        """True/False, or None when ``timeout_s`` passed — waiting for a free worker included.

        A worker that was busy at the deadline is killed and replaced. Identical checks in
        flight at the same time share one worker request (a prompt's samples often give the
        same answer). The request runs in its own task, so a cancelled caller can never leave
        a worker half-way through an answer.
        """
        key = (pred, truth)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.create_task(self._check(pred, truth))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(task)  # the task keeps its own deadline (started first)

    async def _check(self, pred: str, truth: str) -> bool | None:
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            worker = await asyncio.wait_for(self._idle.get(), self.timeout_s)
        except TimeoutError:
            self.timeouts += 1
            return None
        try:
            remaining = deadline - asyncio.get_running_loop().time()
            result = await asyncio.wait_for(worker.ask(pred, truth), max(remaining, 0.001))
        except (TimeoutError, EOFError, OSError, ValueError):
            self.timeouts += 1
            self._all.discard(worker)
            with contextlib.suppress(ProcessLookupError):
                worker.proc.kill()  # now, not in the background task: it may be cancelled
            if not self._stopped:
                task = asyncio.create_task(self._replace(worker))
                self._respawns.add(task)
                task.add_done_callback(self._respawns.discard)
            return None
        self._idle.put_nowait(worker)
        return result

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
