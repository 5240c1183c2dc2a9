"""The shared retry policy (services/common/retry.py, on tenacity) against hand-written loops.

Two questions, each answered in one run:

1. *Cost*: what tenacity adds per call over the smallest hand-written loop with the same policy
   (attempts, deadline, jittered pauses, a retry counter), on a call that succeeds at once and on
   one that fails twice (zero pauses) before it succeeds. Pure CPU, no I/O: an upper bound on what
   the library can cost next to a loopback HTTP call (~1 ms here).
2. *Worst case*: how long a grade waits when the reward service answers every request with
   ``503 Retry-After: 1`` (a real loopback HTTP server): the policy before this change (the agent
   loop retried 3 times around a client that waited out 503s until its own timeout) against the
   shared one (one deadline for the whole call).

    python bench/retry.py            # ~20 s
    python bench/retry.py --quick    # ~10 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.retry import RetryableStatus, RetryPolicy, check_status, retry_call  # noqa: E402


class _Counter:
    """A stand-in for a Prometheus counter (the same for both sides)."""

    def __init__(self) -> None:
        self.n = 0

    def labels(self, *_: str) -> _Counter:
        return self

    def inc(self) -> None:
        self.n += 1


async def hand_loop(fn, policy: RetryPolicy, counter: _Counter):  # type: ignore[no-untyped-def]
    """The baseline: the smallest loop with the same policy (what a shared helper would be)."""
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        left = None if policy.deadline_s is None else policy.deadline_s - (time.monotonic() - start)
        try:
            return await fn(left)
        except (httpx.TransportError, RetryableStatus):
            pause = min(policy.max_s, policy.base_s * 2 ** (attempt - 1) + random.uniform(0, policy.base_s))
            spent = time.monotonic() - start
            out_of_time = policy.deadline_s is not None and spent + pause >= policy.deadline_s
            if (policy.attempts is not None and attempt >= policy.attempts) or out_of_time:
                raise
            counter.inc()
            await asyncio.sleep(pause)


async def cost(calls: int) -> None:
    policy = RetryPolicy(attempts=3, deadline_s=60.0, base_s=0.0, max_s=0.0)
    counter = _Counter()

    def flaky(failures: int):  # type: ignore[no-untyped-def]
        state = {"n": 0}

        async def fn(_: float | None) -> int:
            state["n"] += 1
            if state["n"] <= failures:
                raise httpx.ConnectError("refused")
            return state["n"]

        return fn

    print(f"1. cost per call ({calls} calls each, µs per call, median of 5 rounds)")
    for failures in (0, 2):
        results: dict[str, list[float]] = {"hand-written loop": [], "retry_call (tenacity)": []}
        for _ in range(5):
            for name in results:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn = flaky(failures)
                    if name.startswith("hand"):
                        await hand_loop(fn, policy, counter)
                    else:
                        await retry_call(fn, policy, target="bench", counter=counter)
                results[name].append((time.perf_counter() - t0) / calls * 1e6)
        hand, ours = (sorted(v)[2] for v in results.values())
        print(f"   {failures} failures first: hand-written {hand:.1f} µs, tenacity {ours:.1f} µs "
              f"(+{ours - hand:.1f} µs, {ours / hand:.2f}x)")
    http_us = await _loopback_us(500)
    print(f"   for scale, one loopback HTTP POST (httpx, keep-alive): {http_us:.0f} µs median")


async def _loopback_us(calls: int) -> float:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):  # cancelled at shutdown
            while True:
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if not line:
                    break
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/score"
    times = []
    async with httpx.AsyncClient() as client:
        for _ in range(calls):
            t0 = time.perf_counter()
            await client.post(url, json={"response": "Answer: 4", "ground_truth": "4"})
            times.append(time.perf_counter() - t0)
    server.close()
    await server.wait_closed()
    return sorted(times)[len(times) // 2] * 1e6


async def worst_case(timeout_s: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        writer.write(b"HTTP/1.1 503 Busy\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/score"
    async with httpx.AsyncClient(timeout=timeout_s) as client:

        async def before() -> None:
            """The agent loop's 3 attempts (0.2 s, 0.4 s apart) around the client's 503 wait-out."""
            for attempt in range(3):
                if attempt:
                    await asyncio.sleep(0.2 * 2 ** (attempt - 1))
                deadline = time.monotonic() + timeout_s
                while True:
                    r = await client.post(url, json={})
                    if r.status_code != 503 or time.monotonic() + 1.0 >= deadline:
                        break
                    await asyncio.sleep(1.0)

        async def after() -> None:
            policy = RetryPolicy(attempts=None, deadline_s=timeout_s, base_s=0.2, max_s=5.0)
            with contextlib.suppress(RetryableStatus):
                await retry_call(lambda t: _post(client, url, t), policy, target="reward")

        print(f"2. worst case of one grade, reward always 503 Retry-After: 1, reward_timeout_s={timeout_s:g}")
        for name, fn in (("before: 3 agent attempts x client wait-out", before),
                         ("after: one deadline (retry_call)", after)):
            t0 = time.perf_counter()
            await fn()
            print(f"   {name}: {time.perf_counter() - t0:.2f} s")
    server.close()
    await server.wait_closed()


async def _post(client: httpx.AsyncClient, url: str, timeout: float | None) -> httpx.Response:
    return check_status(await client.post(url, json={}, timeout=timeout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    asyncio.run(cost(2000 if args.quick else 10000))
    asyncio.run(worst_case(2.0 if args.quick else 4.0))


if __name__ == "__main__":
    main()
