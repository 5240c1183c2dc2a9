"""Hand-back of a draining replica's jobs: how long until another replica has them (issue 36).

Two ways, on a private real Redis, with a taker running the worker's loop (take hand-backs, else a
blocking XREADGROUP of ``--block-ms``) and ``--queued`` new prompts already waiting in the stream:
- ``claim``: what services/rollout/handback.py does: XCLAIM to the ``handed-back`` consumer with
  IDLE claim_idle_ms (the entry stays in place); the taker takes it before reading new prompts;
- ``readd``: XADD the job again and XACK the old entry (MULTI/EXEC); a blocked reader gets it at
  once, but behind the queued prompts (the taker must read those first).
With no queue the taker is idle, blocked in its read when the hand-back happens; with a queue it is
busy and its slot frees right after the hand-back. Reported per way: the wait from the hand-back
until the taker holds the job (median, max), and how many queued prompts it was handed first.

    .venv/bin/python bench/handback.py --trials 20 --block-ms 1000 --queued 0
    .venv/bin/python bench/handback.py --trials 20 --block-ms 1000 --queued 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.queue import RedisStream, connect  # noqa: E402
from services.common.redis_server import PrivateRedis  # noqa: E402
from services.rollout.handback import hand_back, take_handed_back  # noqa: E402

STREAM, GROUP, CLAIM_IDLE_MS = "b:prompts", "rollout", 600_000


async def trial(q: RedisStream, way: str, block_ms: int, queued: int,
                rng: random.Random) -> tuple[float, int]:
    await q.client.delete(STREAM)
    await q.ensure_group()
    job = await q.add(b"the drained job")
    await q.read("drained", count=1)
    for _ in range(queued):
        await q.add(b"queued")
    got: asyncio.Future[tuple[float, int]] = asyncio.get_running_loop().create_future()

    async def taker() -> None:
        ahead = 0
        while True:
            msgs = [p.msg for p in await take_handed_back(q, "taker", CLAIM_IDLE_MS, 1)]
            if not msgs:
                msgs = await q.read("taker", count=1, block_ms=block_ms)
            for m in msgs:
                if m.data == b"the drained job":
                    got.set_result((time.perf_counter(), ahead))
                    return
                ahead += 1
                await q.ack(m.id)

    # no queue: an idle taker, blocked in its read, at any phase of it; a queue: a busy taker whose
    # slot frees right after the hand-back (an idle one would have read the queue already)
    task = asyncio.create_task(taker()) if not queued else None
    await asyncio.sleep(block_ms / 1000 * rng.uniform(0.1, 0.9))
    t0 = time.perf_counter()
    if way == "claim":
        await hand_back(q, "drained", CLAIM_IDLE_MS, [job])
    else:
        async with q.client.pipeline(transaction=True) as pipe:
            pipe.xadd(STREAM, {b"d": b"the drained job"})
            pipe.xack(STREAM, GROUP, job)
            pipe.xdel(STREAM, job)
            await pipe.execute()
    task = task or asyncio.create_task(taker())
    t1, ahead = await asyncio.wait_for(got, 60)
    await task
    return t1 - t0, ahead


async def main(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        server = PrivateRedis(Path(tmp), backend="redis-server").start()
        try:
            q = RedisStream(connect(server.url), STREAM, GROUP)
            out: dict[str, object] = {"block_ms": args.block_ms, "queued": args.queued, "trials": args.trials}
            for way in ("claim", "readd"):
                rng = random.Random(args.seed)
                runs = [await trial(q, way, args.block_ms, args.queued, rng) for _ in range(args.trials)]
                waits = sorted(w for w, _ in runs)
                out[way] = {"wait_median_s": round(statistics.median(waits), 4),
                            "wait_max_s": round(waits[-1], 4),
                            "prompts_taken_before": max(a for _, a in runs)}
            await q.client.aclose()
            return out
        finally:
            server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--block-ms", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--queued", type=int, default=0, help="new prompts waiting in the stream already")
    print(json.dumps(asyncio.run(main(ap.parse_args())), indent=1))
