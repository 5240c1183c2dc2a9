"""``retool trainer run``: the RL loop around the FSDP step.

Per step (rank 0 does all I/O; every rank trains):
1. top up the prompts stream within admission control (``StalenessManager``);
2. read ``batch_prompts`` scored groups (stale / duplicate / zero-variance groups dropped
   and counted), turn them into samples with group-relative advantages;
3. ``train_step`` under FSDP (gloo on CPU, NCCL on GPU);
4. gather the full weights, push them to every rollout replica over gRPC, bump the version;
5. every ``save_freq`` steps (and on SIGTERM): checkpoint model, optimizer, RNG, step,
   version, dataset cursor and seen job ids — then acknowledge the groups those steps used.

Invariants: a resumed run continues from its last checkpoint with the same version, cursor
and admission state; groups used after that checkpoint were never acknowledged, so they
are delivered again; metrics go to the console, a JSONL file and Prometheus (rank 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from services.common.config import ConfigError, StrictModel
from services.common.logging import get_logger
from services.common.schemas import ChatMessage, Group, PromptJob, RolloutSampling
from services.trainer.batch import Rollout, build_samples
from services.trainer.config import TrainerConfig
from services.trainer.staleness import StalenessManager

log = get_logger("trainer")
# Fault injection for crash/resume tests: every rank SIGKILLs itself right after this step,
# before any checkpoint of it — a crash at an exact point, like an OOM kill.
FAULT_KILL_AFTER_STEP = "RETOOL_FAULT_KILL_AFTER_STEP"


class RunConfig(StrictModel):
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    dataset: str = Field(..., description="RL parquet from `retool data dapo` (prompt, reward_model columns)")
    redis_url: str = "redis://127.0.0.1:6379/0"
    prompts_stream: str = "retool:prompts"
    groups_stream: str = "retool:groups"
    consumer_group: str = "trainer"
    consumer: str = "trainer-0"
    rollout_targets: list[str] = Field(default_factory=list, description="gRPC host:port of rollout replicas")
    weight_token_env: str = Field("RETOOL_WEIGHT_TOKEN", description="NAME of the env var holding the token")
    weight_bucket_mb: int = Field(4, ge=1, le=64)
    max_steps: int | None = Field(None, ge=1)
    sampling: RolloutSampling = Field(default_factory=RolloutSampling)
    max_turns: int | None = Field(None, ge=0)
    incorrect_reward: float = Field(
        -1.0, description="reward of a trajectory the reward service did not score"
    )
    metrics_path: str = "runs/trainer/metrics.jsonl"
    groups_log: str | None = Field(None, description="JSONL of the job ids each step trained on (audit)")
    metrics_port: int | None = Field(None, ge=0, le=65535)
    group_wait_s: float = Field(600.0, gt=0, description="give up when no group arrives for this long")
    val_dataset: str | None = Field(
        None, description="validation parquet (`retool data aime`); None = no validation"
    )
    rollout_urls: list[str] = Field(default_factory=list, description="rollout HTTP URLs used for validation")
    val_sampling: RolloutSampling = Field(default_factory=lambda: RolloutSampling(temperature=1.0, top_p=0.6))
    val_concurrency: int = Field(8, ge=1, description="validation prompts in flight")

    @model_validator(mode="after")
    def _supported(self) -> RunConfig:
        if self.trainer.algorithm != "grpo":
            raise ValueError(
                f"trainer.algorithm={self.trainer.algorithm!r}: the run loop trains with grpo only; "
                "the critic-based ppo estimator (GAE and value loss exist in services/trainer/algo) "
                "is not wired into it yet"
            )
        return self


def load_prompt_jobs(
    path: str | Path, group_size: int, sampling: RolloutSampling, max_turns: int | None
) -> list[PromptJob]:
    """Prompt jobs from an RL parquet (``retool data dapo`` / ``aime`` output)."""
    from services.data.io import iter_rows

    jobs = []
    for index, row in iter_rows(path):
        messages = [ChatMessage(role=m["role"], content=m["content"]) for m in row["prompt"]]
        extra = row.get("extra_info") or {}
        jobs.append(
            PromptJob(
                job_id=str(extra.get("index") or index),
                messages=messages,
                ground_truth=str(row["reward_model"]["ground_truth"]),
                data_source=row.get("data_source"),
                n=group_size,
                sampling=sampling,
                max_turns=max_turns,
            )
        )
    if not jobs:
        raise ConfigError(f"dataset {path} has no rows")
    return jobs


def rollouts_of(groups: Sequence[Group], incorrect_reward: float) -> list[Rollout]:
    return [
        Rollout(
            group_id=g.job_id,
            prompt_ids=g.prompt_ids,
            response_ids=t.response_ids,
            response_loss_mask=t.loss_mask,
            reward=t.reward if t.reward is not None else incorrect_reward,
            rollout_logprobs=t.logprobs,
            truncated=t.truncated,
        )
        for g in groups
        for t in g.trajectories
    ]


class MetricsSink:
    """Console + JSONL (+ Prometheus gauges when a port is given), rank 0 only."""

    def __init__(self, path: str, port: int | None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.gauges: dict[str, Any] = {}
        self.registry = None
        if port is not None:
            from prometheus_client import start_http_server

            from services.common.metrics import MetricsRegistry

            self.registry = MetricsRegistry("trainer")
            start_http_server(port, registry=self.registry.registry)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.registry is not None:
            for key, value in metrics.items():
                name = key.replace("/", "_").replace("@", "_at_").replace("-", "_").replace(".", "_")
                if name not in self.gauges:
                    self.gauges[name] = self.registry.gauge(name, key)
                self.gauges[name].set(value)
        shown = {
            k: round(v, 4)
            for k, v in metrics.items()
            if k
            in (
                "critic/score/mean",
                "actor/pg_loss",
                "actor/pg_clipfrac",
                "actor/grad_norm",
                "weights/push_seconds",
                "perf/step_seconds",
                "rollout/staleness_mean",
            )
        }
        log.info("step %d %s", step, shown)


class Trainer:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self.stop_requested = False

    # ---- set-up -----------------------------------------------------------------------------
    def _setup_model(self) -> None:
        from transformers import AutoModelForCausalLM

        from services.trainer.actor import Actor
        from services.trainer.fsdp import apply_fsdp2, build_optimizer, init_distributed

        if self.tcfg.model_path is None:
            raise ConfigError("trainer.model_path: a Hugging Face model directory is required")
        torch.manual_seed(self.tcfg.seed)
        if "RANK" not in os.environ:  # not under torchrun: a one-process group on loopback
            from services.common.process import free_port

            os.environ.update(
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            )
        self.rank, self.world, mesh = init_distributed(self.tcfg)
        lm = AutoModelForCausalLM.from_pretrained(self.tcfg.model_path, dtype=torch.float32)
        self.actor = Actor(lm, chunk_tokens=self.tcfg.logprob_chunk_tokens, temperature=self.tcfg.temperature)
        if self.world > 1:
            apply_fsdp2(self.actor, self.tcfg.fsdp, mesh)
        self.optimizer = build_optimizer(self.actor, self.tcfg)

    async def _setup_streams(self) -> None:
        from services.common.queue import RedisStream, connect
        from services.trainer.feed import GroupReader, PromptFeeder

        self.redis = connect(self.cfg.redis_url)
        groups = RedisStream(self.redis, self.cfg.groups_stream, self.cfg.consumer_group)
        await groups.ensure_group()
        prompts = RedisStream(self.redis, self.cfg.prompts_stream)
        jobs = load_prompt_jobs(self.cfg.dataset, self.tcfg.group_size, self.cfg.sampling, self.cfg.max_turns)
        self.manager = StalenessManager(self.tcfg.batch_prompts, self.tcfg.max_staleness)
        self.feeder = PromptFeeder(prompts, jobs, self.manager, epochs=self.tcfg.total_epochs)
        self.reader = GroupReader(groups, self.cfg.consumer, self.manager)

    def _resume(self) -> int:
        from services.trainer.checkpoint import latest_checkpoint, load_checkpoint

        latest = latest_checkpoint(self.tcfg.checkpoint_dir)
        if latest is None:
            return 0
        meta = load_checkpoint(latest.path, self.actor, self.optimizer)
        if self.rank == 0:
            self.feeder.load_state_dict(meta.extra["feeder"])
            self.reader.load_state_dict(meta.extra["reader"])
        log.info(
            "resumed from %s (step %d, version %d)", latest.path, meta.step, meta.extra["feeder"]["version"]
        )
        return meta.step

    # ---- one step ---------------------------------------------------------------------------
    async def _collect(self) -> tuple[list[Rollout], dict[str, float]]:
        await self.feeder.top_up()
        keep = None
        if self.tcfg.dynamic_sampling.enabled:

            def keep(g: Group) -> bool:
                return len({t.reward for t in g.trajectories}) > 1

        deadline = time.monotonic() + self.cfg.group_wait_s
        groups, dropped, staleness = [], {}, []
        limit = self.tcfg.dynamic_sampling.max_groups_pulled
        while len(groups) < self.tcfg.batch_prompts:
            pulled = len(groups) + sum(dropped.values())
            if limit is not None and pulled >= limit:
                raise RuntimeError(
                    f"dynamic_sampling.max_groups_pulled={limit} reached with only {len(groups)} "
                    f"of {self.tcfg.batch_prompts} usable groups (dropped: {dropped})"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no full batch within group_wait_s={self.cfg.group_wait_s}: got {len(groups)} "
                    f"of {self.tcfg.batch_prompts} groups (is a rollout worker consuming "
                    f"{self.cfg.prompts_stream}?)"
                )
            batch = await self.reader.next_batch(
                self.tcfg.batch_prompts - len(groups), keep=keep, block_ms=1000, max_wait_rounds=5
            )
            groups += batch.groups
            staleness += batch.staleness
            for reason, n in batch.dropped.items():
                dropped[reason] = dropped.get(reason, 0) + n
            if batch.dropped:
                await self.feeder.top_up()  # dropped groups leave admission room unused: refill
        stats = {f"rollout/dropped_{k}": float(v) for k, v in dropped.items()}
        stats["rollout/staleness_mean"] = sum(staleness) / len(staleness)
        stats["rollout/turns_mean"] = sum(t.turns for g in groups for t in g.trajectories) / sum(
            len(g.trajectories) for g in groups
        )
        stats["rollout/tool_calls_mean"] = sum(t.tool_calls for g in groups for t in g.trajectories) / sum(
            len(g.trajectories) for g in groups
        )
        stats["rollout/accuracy"] = sum(bool(t.correct) for g in groups for t in g.trajectories) / sum(
            len(g.trajectories) for g in groups
        )
        self._last_job_ids = [g.job_id for g in groups]
        return rollouts_of(groups, self.cfg.incorrect_reward), stats

    async def _validate(self) -> dict[str, float]:
        """``val_n`` samples per validation prompt through the rollout fleet (reference metric names)."""
        if not self.cfg.val_dataset or self.rank != 0:
            return {}
        import httpx

        from services.trainer.algo.validation_metrics import ValSample, compute_validation_metrics

        if not self.cfg.rollout_urls:
            raise ConfigError("rollout_urls: validation needs at least one rollout HTTP URL")
        jobs = load_prompt_jobs(
            self.cfg.val_dataset, self.tcfg.val_n, self.cfg.val_sampling, self.cfg.max_turns
        )
        sem = asyncio.Semaphore(self.cfg.val_concurrency)
        samples: list[ValSample] = []

        async def one(i: int, job: PromptJob, client: httpx.AsyncClient) -> None:
            url = self.cfg.rollout_urls[i % len(self.cfg.rollout_urls)]
            body = {
                "messages": [m.model_dump() for m in job.messages or []],
                "ground_truth": job.ground_truth,
                "data_source": job.data_source,
                "n": job.n,
                "sampling": job.sampling.model_dump(),
                "max_turns": job.max_turns,
            }
            async with sem:
                r = await client.post(
                    f"{url}/v1/rollouts", json={k: v for k, v in body.items() if v is not None}
                )
            r.raise_for_status()
            group = Group.model_validate(r.json())
            for t in group.trajectories:
                samples.append(
                    ValSample(
                        data_source=job.data_source or "val",
                        problem_id=job.job_id,
                        acc=float(bool(t.correct)),
                        reward=float(t.reward or 0.0),
                        pred=t.extracted,
                        num_turns=t.turns,
                    )
                )

        start = time.perf_counter()
        async with httpx.AsyncClient(timeout=None) as client:
            await asyncio.gather(*(one(i, job, client) for i, job in enumerate(jobs)))
        metrics = compute_validation_metrics(samples, seed=self.tcfg.seed)
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        metrics["val/seconds"] = time.perf_counter() - start
        return metrics

    def _broadcast(self, payload: Any) -> Any:
        if self.world == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    async def _push(self, version: int) -> dict[str, float]:
        from services.trainer.fsdp import full_state_dict

        weights = full_state_dict(self.actor)  # collective
        if self.rank != 0 or not self.cfg.rollout_targets:
            return {}
        from services.rollout.weights.client import push_state_dict_async

        token = os.environ.get(self.cfg.weight_token_env)
        if not token:
            raise ConfigError(
                f"weight_token_env: environment variable {self.cfg.weight_token_env} is not set"
            )
        named = ((k.removeprefix("lm."), v) for k, v in weights.items())
        report = await push_state_dict_async(
            named, self.cfg.rollout_targets, version, token, bucket_bytes=self.cfg.weight_bucket_mb * 2**20
        )
        return {"weights/push_seconds": report.seconds, "weights/push_gbps": report.gbps}

    def _save(self, step: int) -> None:
        from services.trainer.checkpoint import save_checkpoint

        extra = (
            {"feeder": self.feeder.state_dict(), "reader": self.reader.state_dict()} if self.rank == 0 else {}
        )
        extra = self._broadcast(extra)
        save_checkpoint(
            self.tcfg.checkpoint_dir,
            step,
            self.actor,
            self.optimizer,
            keep_last=self.tcfg.keep_last_checkpoints,
            extra=extra,
        )

    async def run(self) -> int:
        from tqdm import tqdm

        from services.trainer.step import DPInfo, StepSettings, train_step

        self._setup_model()
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop_requested", True))
        if self.rank == 0:
            await self._setup_streams()
            sink = MetricsSink(self.cfg.metrics_path, self.cfg.metrics_port)
        else:
            self.feeder = self.reader = None  # type: ignore[assignment]
        step = self._resume()
        version = self._broadcast(self.manager.version if self.rank == 0 else 0)
        settings = StepSettings.from_config(self.tcfg)
        dp = DPInfo(self.rank, self.world)
        total = self._broadcast(
            self.cfg.max_steps
            or (len(self.feeder.dataset) * self.tcfg.total_epochs // self.tcfg.batch_prompts)
            if self.rank == 0
            else 0
        )
        bar = tqdm(total=total, initial=step, desc="train", disable=self.rank != 0)
        if step == 0 and self.tcfg.val_before_train and self.rank == 0 and (val := await self._validate()):
            sink.write(0, val)
        while step < total:
            start = time.perf_counter()
            payload = await self._collect() if self.rank == 0 else None
            rollouts, stats = self._broadcast(payload)
            samples, batch_metrics = build_samples(
                rollouts,
                norm_by_std=self.tcfg.norm_adv_by_std,
                overlong=self.tcfg.overlong,
                max_response_len=self.tcfg.max_response_len,
            )
            step_metrics = train_step(self.actor, self.optimizer, samples, settings, dp)
            version += 1
            push = await self._push(version)
            step += 1
            if self.rank == 0:
                self.manager.advance(version)
                metrics = {
                    **stats,
                    **batch_metrics,
                    **step_metrics,
                    **push,
                    "policy/version": float(version),
                    "perf/step_seconds": time.perf_counter() - start,
                }
                if step % self.tcfg.test_freq == 0 or step >= total:
                    metrics.update(await self._validate())
                sink.write(step, metrics)
                if self.cfg.groups_log:
                    with open(self.cfg.groups_log, "a") as fh:
                        fh.write(json.dumps({"step": step, "job_ids": self._last_job_ids}) + "\n")
            bar.update(1)
            if os.environ.get(FAULT_KILL_AFTER_STEP) == str(step):  # fault injection (tests): a hard crash
                os.kill(os.getpid(), signal.SIGKILL)
            stop = self._broadcast(self.stop_requested)
            if step % self.tcfg.save_freq == 0 or stop or step >= total:
                self._save(step)
                if self.rank == 0:
                    await self.reader.commit()
            if stop:
                log.info("SIGTERM: checkpoint written at step %d, exiting", step)
                break
        bar.close()
        if self.rank == 0:
            await self.redis.aclose()
        if dist.is_initialized():
            dist.barrier()  # every rank is past its last collective before gloo/NCCL is torn down
            dist.destroy_process_group()
        return step
