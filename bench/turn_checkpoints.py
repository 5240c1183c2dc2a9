"""Turn checkpoint overhead: rollout throughput with checkpoints on vs off, and bytes written per token.

One process runs a private Redis and a ``RolloutWorker`` on ``engine: synthetic`` (preset
``infinite``: no modelled GPU time, so the engine is as fast as this CPU lets the agent loop go and
any checkpoint cost shows in full) with the Qwen2.5 tokenizer (3-byte ids, as the recipe), responses
up to 16,384 tokens and up to 8 tool turns. Tool calls get an instant fixed answer (the sandbox's run
time would only dilute the overhead). Rounds alternate on/off (ABBA...) over the same jobs shapes;
each round enqueues ``--jobs`` prompt jobs of ``--n`` samples and times until all groups are
published.

Every job is seeded, so every round generates the same responses: an on/off pair differs only by the
checkpoints (``same_responses_each_round`` says whether that held). Reports tokens/s per mode, the
throughput ratio on/off (the overhead) over all rounds and per pair with its median, checkpoint
bytes per response token, the share of the wall time spent writing checkpoints, and writes JSON
with ``--json``.

Usage: ``python bench/turn_checkpoints.py --jobs 8 --n 16 --rounds 4``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.chat.tool_result import ToolResult  # noqa: E402
from services.common.queue import RedisStream, connect  # noqa: E402
from services.common.redis_server import PrivateRedis  # noqa: E402
from services.common.schemas import ChatMessage, Group, PromptJob, RolloutSampling  # noqa: E402
from services.rollout.agent.checkpoint import CheckpointObserver  # noqa: E402
from services.rollout.agent.loop import AgentLoop, AgentObserver  # noqa: E402
from services.rollout.config import AgentConfig, RedisWorkerConfig  # noqa: E402
from services.rollout.worker import RolloutWorker  # noqa: E402


class BenchObserver(AgentObserver, CheckpointObserver):
    """The checkpoint counters of one round (agent hooks do nothing)."""


class InstantTool:
    """A fixed interpreter answer at once: the overhead is measured against generation alone."""

    async def run(self, code: str, session_id: str | None = None) -> ToolResult:
        return ToolResult("42\n", False, 0.0)


async def one_round(client: Any, agent: AgentLoop, args: argparse.Namespace, on: bool,
                    tag: str) -> dict[str, Any]:
    prompts_stream, groups_stream = f"b:{tag}:prompts", f"b:{tag}:groups"
    prompts, groups = RedisStream(client, prompts_stream, "rollout"), RedisStream(client, groups_stream)
    await prompts.ensure_group()
    for k in range(args.jobs):
        # seeded: every round repeats the same responses (lengths, turns), so an on/off pair differs
        # only by the checkpoints, not by the response-length tail of that round's draw
        job = PromptJob(messages=[ChatMessage(role="user", content=f"Problem #{k}: compute it.")], n=args.n,
                        sampling=RolloutSampling(seed=1000 * k))
        await prompts.add(job.to_msgpack())
    obs = BenchObserver()
    agent.observer = obs
    cfg = RedisWorkerConfig(url="unused", prompts_stream=prompts_stream, groups_stream=groups_stream,
                            consumer=tag, concurrency=args.jobs, block_ms=20, checkpoints=on)
    worker = RolloutWorker(agent, prompts, groups, cfg)
    stop = asyncio.Event()
    start = time.perf_counter()
    task = asyncio.create_task(worker.run(stop))
    while await groups.depth() < args.jobs:
        assert not task.done(), task
        if worker.stats.jobs_failed:
            raise RuntimeError("a rollout job failed (see the log above)")
        await asyncio.sleep(0.01)
    wall = time.perf_counter() - start
    stop.set()
    await task
    tokens = generated = 0
    for _, fields in await client.xrange(groups_stream):
        for t in Group.from_msgpack(fields[b"d"]).trajectories:
            tokens += len(t.response_ids)
            generated += sum(t.loss_mask)
    left = [k async for k in client.scan_iter(match=f"{prompts_stream}:ckpt:*")]
    return {"checkpoints": on, "wall_s": wall, "response_tokens": tokens, "generated_tokens": generated,
            "tokens_per_s": tokens / wall, "ckpt_bytes": obs.bytes_written,
            "ckpt_seconds": obs.seconds_writing,
            "ckpt_keys_left": len(left)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from services.models.tiny import init_model_dir
    from services.rollout.engine.synthetic import SyntheticEngine

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    model = work / "model"
    if not (model / "config.json").exists():
        init_model_dir(model, "tiny", 0, tokenizer="qwen2.5")
    redis = PrivateRedis(work / "redis", backend="redis-server")
    redis.start()
    engine = SyntheticEngine(model, preset=args.preset, max_tool_calls=8, seed=1)
    agent = AgentLoop(engine, engine.tokenizer, InstantTool(),  # type: ignore[arg-type]
                      AgentConfig(max_turns=8, max_response_tokens=16384, include_text=False))
    client = connect(redis.url)
    rounds = []
    try:
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for on in order:
                res = await one_round(client, agent, args, on, f"r{r}{'on' if on else 'off'}")
                rounds.append(res)
                print(json.dumps(res), flush=True)
    finally:
        await client.aclose()
        await engine.shutdown()
        redis.stop()
    on_runs = [x for x in rounds if x["checkpoints"]]
    off_runs = [x for x in rounds if not x["checkpoints"]]
    tps_on = sum(x["response_tokens"] for x in on_runs) / sum(x["wall_s"] for x in on_runs)
    tps_off = sum(x["response_tokens"] for x in off_runs) / sum(x["wall_s"] for x in off_runs)
    tokens_on = sum(x["response_tokens"] for x in on_runs)
    pairs = [on_runs[i]["tokens_per_s"] / off_runs[i]["tokens_per_s"] for i in range(min(len(on_runs),
                                                                                          len(off_runs)))]
    summary = {
        "jobs": args.jobs, "n": args.n, "rounds": args.rounds, "preset": args.preset,
        "mean_response_tokens": tokens_on / (len(on_runs) * args.jobs * args.n),
        "tokens_per_s_on": tps_on, "tokens_per_s_off": tps_off,
        "throughput_ratio_on_over_off": tps_on / tps_off,
        "overhead_pct": 100 * (1 - tps_on / tps_off),
        "pair_ratios_on_over_off": [round(x, 4) for x in pairs],  # one per round (same responses)
        "median_pair_overhead_pct": 100 * (1 - statistics.median(pairs)),
        "same_responses_each_round": len({x["response_tokens"] for x in rounds}) == 1,
        "ckpt_bytes_per_token": sum(x["ckpt_bytes"] for x in on_runs) / tokens_on,
        # encoding + sends, summed over the jobs' writers (which overlap each other and generation)
        "ckpt_seconds_over_wall_pct": 100 * sum(x["ckpt_seconds"] for x in on_runs)
        / sum(x["wall_s"] for x in on_runs),
        "ckpt_keys_left": sum(x["ckpt_keys_left"] for x in rounds),
    }
    return {"summary": summary, "rounds": rounds}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=8, help="prompt jobs per round (all run at once)")
    p.add_argument("--n", type=int, default=16, help="samples per job")
    p.add_argument("--rounds", type=int, default=4, help="rounds of (on, off) pairs, order alternating")
    p.add_argument("--preset", default="infinite", help="synthetic engine timing (h100-7b: a modelled GPU)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    out = asyncio.run(main(a))
    print(json.dumps(out["summary"], indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
