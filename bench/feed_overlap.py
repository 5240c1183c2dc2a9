"""The trainer's feed off the critical path: step wall time with ``trainer.feed_overlap`` off and on.

The real loop (``Trainer.train``: admission, read, decode, validate, dedupe, staleness, ledger,
checkpoints and commits every ``--save-freq`` steps) on a private Redis, fed by a rollout stand-in
that answers every admitted job at once with a group of ``--group-size`` responses of
``--response-tokens`` tokens (one pre-encoded group per policy version, its job id swapped in).
The update is the real packing (``build_samples``) plus ``--update-s`` of sleep standing in for
forward and backward on an accelerator (it holds no GIL, as CUDA kernels do not). Both modes run
in the same process, on the same data, one after the other; the first step of each is left out
(nothing is read ahead of it).

    PYTHONPATH=$PWD .venv/bin/python bench/feed_overlap.py            # ~1 minute
    PYTHONPATH=$PWD .venv/bin/python bench/feed_overlap.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import torch

from services.common.queue import RedisStream, connect
from services.common.redis_server import PrivateRedis
from services.common.schemas import Group, PromptJob, Trajectory
from services.trainer.batch import Rollout, build_samples
from services.trainer.config import TrainerConfig
from services.trainer.loop import RunConfig, Trainer


class Rollouts:
    """Answers each admitted job with a scored group (rewards alternate: every group is kept)."""

    def __init__(self, url: str, group_size: int, response_tokens: int, prompt_tokens: int) -> None:
        self.client = connect(url)
        self.prompts = RedisStream(self.client, "prompts", "rollout")
        self.groups = RedisStream(self.client, "groups")
        self.shape = (group_size, response_tokens, prompt_tokens)
        self.templates: dict[int, dict[str, Any]] = {}

    def template(self, version: int) -> dict[str, Any]:
        if version not in self.templates:
            n, length, prompt = self.shape
            group = Group(
                job_id="template", prompt_ids=[(7 * i) % 50_000 + 1 for i in range(prompt)],
                trajectories=[Trajectory(
                    index=i, response_ids=[(13 * j + i) % 50_000 + 1 for j in range(length)],
                    loss_mask=[1] * length, logprobs=[-0.5] * length, versions=[version] * length,
                    finish_reason="eos", reward=1.0 if i % 2 else -1.0, turns=1) for i in range(n)],
                min_version=version, max_version=version, job_policy_version=version)
            self.templates[version] = msgpack.unpackb(group.to_msgpack(), raw=False)
        return self.templates[version]

    async def run(self) -> None:
        await self.prompts.ensure_group()
        while True:
            for m in await self.prompts.read("w0", count=64, block_ms=50):
                job = PromptJob.from_msgpack(m.data)
                data = {**self.template(job.policy_version), "job_id": job.job_id}
                await self.groups.add(msgpack.packb(data, use_bin_type=True))
                await self.prompts.ack(m.id, delete=True)


class BenchLoop(Trainer):
    """The real loop; the model is a stand-in (checkpointed for real) and the update is the real
    packing plus a sleep for forward and backward."""

    def __init__(self, cfg: RunConfig, jobs: list[PromptJob], update_s: float) -> None:
        super().__init__(cfg, jobs=jobs)
        self.rank, self.world = 0, 1
        self.actor = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.actor.parameters(), lr=0.1)
        self.critic = self.critic_optimizer = None
        self.update_s = update_s

    def _train(self, rollouts: list[Rollout], step: int) -> dict[str, float]:
        start = time.perf_counter()
        samples, _ = build_samples(rollouts, norm_by_std=True, overlong=self.tcfg.overlong,
                                   max_response_len=self.tcfg.max_response_len)
        assert len(samples) == self.tcfg.train_batch_responses
        time.sleep(self.update_s)
        return {"bench/update_seconds": time.perf_counter() - start}


async def one_mode(url: str, args: argparse.Namespace, out: Path, overlap: bool) -> list[dict[str, Any]]:
    client = connect(url)
    await client.flushdb()
    await client.aclose()
    tcfg = TrainerConfig(
        batch_prompts=args.batch_prompts, group_size=args.group_size,
        mini_batch_size=args.batch_prompts * args.group_size, max_staleness=1,
        max_prompt_len=args.prompt_tokens, max_response_len=args.response_tokens,
        micro_batch_max_tokens=args.prompt_tokens + args.response_tokens, save_freq=args.save_freq,
        checkpoint_dir=str(out / "ckpt"), feed_overlap=overlap, val_before_train=False)
    cfg = RunConfig(dataset="unused.parquet", trainer=tcfg, redis_url=url, prompts_stream="prompts",
                    groups_stream="groups", max_steps=args.steps, metrics_path=str(out / "metrics.jsonl"))
    jobs = [PromptJob(job_id=f"p{i}", prompt_ids=[1, i + 2], n=args.group_size)
            for i in range(args.steps * args.batch_prompts)]
    rollouts = Rollouts(url, args.group_size, args.response_tokens, args.prompt_tokens)
    producer = asyncio.create_task(rollouts.run())
    try:
        steps = await BenchLoop(cfg, jobs, args.update_s).train()
    finally:
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await producer
        await rollouts.client.aclose()
    assert steps == args.steps, steps
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    rows = rows[1:]  # step 1: nothing read ahead of it in either mode
    return {
        "step_seconds_median": statistics.median(r["perf/step_seconds"] for r in rows),
        "feed_wait_seconds_mean": statistics.mean(r["perf/feed_wait_seconds"] for r in rows),
        "feed_overlap_seconds_mean": statistics.mean(r["perf/feed_overlap_seconds"] for r in rows),
        "update_seconds_mean": statistics.mean(r["bench/update_seconds"] for r in rows),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        redis = PrivateRedis(Path(tmp) / "redis", backend="redis-server").start()
        try:
            off = summary(await one_mode(redis.url, args, Path(tmp) / "off", overlap=False))
            on = summary(await one_mode(redis.url, args, Path(tmp) / "on", overlap=True))
        finally:
            redis.stop()
    tokens = args.batch_prompts * args.group_size * args.response_tokens
    return {"tokens_per_step": tokens, "update_s": args.update_s, "off": off, "on": on,
            "step_ratio_on_over_off": on["step_seconds_median"] / off["step_seconds_median"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small groups, 4 steps")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--response-tokens", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--update-s", type=float, default=1.0, help="sleep standing in for forward/backward")
    ap.add_argument("--save-freq", type=int, default=5)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.batch_prompts, args.response_tokens, args.update_s = 4, 8, 500, 0.3
    result = asyncio.run(main_async(args))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
