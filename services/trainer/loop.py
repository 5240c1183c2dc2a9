"""``retool trainer run``: the RL loop around the FSDP step.

Per step (rank 0 does all I/O; every rank trains):
1. top up the prompts stream within admission control (``StalenessManager``);
2. read ``batch_prompts`` scored groups (stale / duplicate / zero-variance groups dropped
   and counted), turn them into samples with group-relative advantages; with
   ``trainer.feed_overlap`` the next step's groups are read while this step's update runs in a
   worker thread (``prefetch.py``: same batches, never acknowledged before they are trained);
3. ``train_step`` under FSDP (gloo on CPU, NCCL on GPU); with ``algorithm: ppo``,
   ``ppo.ppo_train_step``: critic values, GAE advantages, critic update, actor update;
4. gather the full weights, push them to every rollout replica over gRPC, bump the version;
5. every ``save_freq`` steps (and on SIGTERM): checkpoint model, optimizer (and the critic's), RNG, step,
   version, dataset cursor, outstanding and seen job ids — then acknowledge the groups (and dead
   letters) those steps used.

``Trainer.run`` sets the model up and calls ``train``, whose loop calls ``step_once`` for each
step: one seam, so the admission and recovery tests drive this very loop (with the FSDP step
stubbed) instead of a copy of it.

The training ledger (``ledger.py``, ``<checkpoint_dir>/ledger.jsonl``) records every admission,
every step's job ids, every drop with its reason, re-issues, checkpoints and resumes, so
``retool trainer ledger`` can prove that no admitted job was trained twice or lost silently.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from tqdm import tqdm

from services.common.config import ConfigError
from services.common.logging import get_logger
from services.common.metrics import MetricsRegistry
from services.common.process import free_port
from services.common.queue import RedisStream, connect
from services.common.schemas import Group, PromptJob
from services.common.security import read_secret
from services.common.tool_curves import tool_curves
from services.data.prompt_jobs import load_prompt_jobs
from services.trainer import fault_mask
from services.trainer.actor import Actor
from services.trainer.algo.validation_metrics import compute_validation_metrics, val_samples
from services.trainer.batch import Rollout, build_samples
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.critic import build_critic_optimizer, load_critic
from services.trainer.discovery import resolve
from services.trainer.feed import Batch, DeadLetters, GroupReader, PromptFeeder
from services.trainer.fsdp import (
    apply_fsdp2,
    build_optimizer,
    encode_on_device,
    full_state_dict,
    init_distributed,
    wants_fsdp,
)
from services.trainer.ledger import LedgerWriter, ledger_path
from services.trainer.observability import TrainerExporter, note_reissued, note_resumed, queue_stats
from services.trainer.ppo import CriticSettings, ppo_train_step
from services.trainer.prefetch import Prefetch
from services.trainer.push import WeightPusher
from services.trainer.run_config import RunConfig  # noqa: F401 - re-exported (retool trainer run)
from services.trainer.staleness import StalenessManager
from services.trainer.step import DPInfo, StepSettings, model_device, train_step
from services.trainer.trackers import Tracker, open_trackers
from services.transport.rollout.client import rollout_groups
from services.transport.weights.synthetic_payload import payload_tensors
from services.transport.weights.tls import ChannelSecurity

log = get_logger("trainer")
# Fault injection for crash/resume tests: every rank SIGKILLs itself right after this step,
# before any checkpoint of it — a crash at an exact point, like an OOM kill.
FAULT_KILL_AFTER_STEP = "RETOOL_FAULT_KILL_AFTER_STEP"


def planned_steps(max_steps: int | None, prompts: int, epochs: int, batch_prompts: int) -> int:
    """Steps the run makes: what the data holds over ``epochs``, cut to ``max_steps`` when set.

    Like verl's ``total_training_steps``, ``max_steps`` never extends the run past its data:
    the trainer would otherwise wait for groups of prompts it never admits.
    """
    data_steps = prompts * epochs // batch_prompts
    if data_steps == 0:
        raise ConfigError(
            f"dataset: {prompts} prompts x total_epochs={epochs} do not fill one batch of "
            f"batch_prompts={batch_prompts}"
        )
    if max_steps is None:
        return data_steps
    if max_steps > data_steps:
        log.warning(
            "max_steps=%d exceeds the %d steps that %d prompts x total_epochs=%d make at "
            "batch_prompts=%d; the run ends at step %d",
            max_steps, data_steps, prompts, epochs, batch_prompts, data_steps,
        )
    return min(max_steps, data_steps)


def rollouts_of(groups: Sequence[Group], incorrect_reward: float) -> list[Rollout]:
    fault = fault_mask.mode()  # None in every real run (test-only fault injection)
    out = []
    for g in groups:
        for t in g.trajectories:
            ids, mask, lps = fault_mask.break_layout(t.response_ids, t.loss_mask, t.logprobs, fault)
            out.append(Rollout(
                group_id=g.job_id,
                prompt_ids=g.prompt_ids,
                response_ids=ids,
                response_loss_mask=mask,
                reward=t.reward if t.reward is not None else incorrect_reward,
                rollout_logprobs=lps,
                truncated=t.truncated,
            ))
    return out


class MetricsSink:
    """Console + JSONL (+ Prometheus gauges when a port is given), rank 0 only."""

    def __init__(self, path: str, port: int | None, max_staleness: int | None = None,
                 trackers: list[Tracker] | None = None, host: str = "127.0.0.1") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers = trackers or []
        self.exporter = None
        if port is not None:  # /metrics + /healthz, and the fixed series the alerts use

            self.exporter = TrainerExporter(MetricsRegistry("trainer"), port, host)
            if max_staleness is not None:
                self.exporter.staleness_limit.set(max_staleness)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.exporter is not None:
            self.exporter.record(step, metrics)
        for tracker in self.trackers:
            tracker.log(step, metrics)
        shown = {
            k: round(v, 4)
            for k, v in metrics.items()
            if k
            in (
                "critic/score/mean",
                "actor/pg_loss",
                "actor/pg_clipfrac",
                "actor/grad_norm",
                "critic/vf_loss",
                "weights/push_seconds",
                "perf/step_seconds",
                "rollout/staleness_mean",
                "step_mode=null",
            )
        }
        log.info("step %d %s", step, shown)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


StepOutcome = Literal["trained", "stopped", "used_up"]


@dataclass
class Collected:
    """A full batch (rank 0): what every rank trains on, and the groups behind it."""

    rollouts: list[Rollout]
    stats: dict[str, float]
    held: Batch  # its groups and entries: the ledger's job ids, a release on a stop or a checkpoint


class Trainer:
    """The RL loop. ``run`` sets up the model and calls ``train``: streams, resume, then
    ``step_once`` until the planned steps are made, the data is used up or a stop is requested.

    ``jobs``: the prompt jobs to admit instead of loading ``cfg.dataset`` (tests drive the real
    loop with scripted jobs; the service always loads the dataset)."""

    def __init__(self, cfg: RunConfig, *, jobs: Sequence[PromptJob] | None = None) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self.stop_requested = False
        self.vocab_size: int | None = None  # the model's; the feed drops groups with ids beyond it
        self.jobs = list(jobs) if jobs is not None else None
        self.step = 0
        self.version = 0
        self._prefetch: Prefetch[Collected | Literal["stop", "used_up"]] | None = None  # rank 0

    # ---- set-up -----------------------------------------------------------------------------
    def _setup_model(self) -> None:
        # lazy: transformers adds ~5 s of import; the admission/recovery tests drive the loop without it
        from transformers import AutoModelForCausalLM

        if self.tcfg.model_path is None:
            raise ConfigError("trainer.model_path: a Hugging Face model directory is required")
        if self.tcfg.step_mode == "null":
            log.warning("step_mode=null: forward and backward are skipped (benchmark mode, the policy never "
                        "changes); feed, packing and push run for real")
        torch.manual_seed(self.tcfg.seed)
        if "RANK" not in os.environ:  # not under torchrun: a one-process group on loopback

            os.environ.update(
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            )
        self.rank, self.world, mesh = init_distributed(self.tcfg)
        lm = AutoModelForCausalLM.from_pretrained(self.tcfg.model_path, dtype=torch.float32)
        self.vocab_size = lm.get_input_embeddings().num_embeddings
        self.actor = Actor(lm, chunk_tokens=self.tcfg.logprob_chunk_tokens, temperature=self.tcfg.temperature)
        if wants_fsdp(self.world):
            apply_fsdp2(self.actor, self.tcfg.fsdp, mesh)
        self.optimizer = build_optimizer(self.actor, self.tcfg)
        self.critic: torch.nn.Module | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if self.tcfg.algorithm == "ppo":
            ccfg = self.tcfg.critic
            self.critic = load_critic(ccfg.model_path or self.tcfg.model_path, head_seed=self.tcfg.seed)
            if wants_fsdp(self.world):
                apply_fsdp2(self.critic, self.tcfg.fsdp, mesh)
            self.critic_optimizer = build_critic_optimizer(self.critic, ccfg.lr, self.tcfg.betas,
                                                           self.tcfg.weight_decay)

    def _components(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """Checkpointed beside the actor (the PPO critic)."""
        if self.critic is None or self.critic_optimizer is None:
            return {}
        return {"critic": (self.critic, self.critic_optimizer)}

    async def _setup_streams(self) -> None:
        self.redis = connect(self.cfg.redis_url, self.cfg.redis_auth)
        groups = RedisStream(self.redis, self.cfg.groups_stream, self.cfg.consumer_group)
        await groups.ensure_group()
        dead = RedisStream(self.redis, f"{self.cfg.prompts_stream}:dead", self.cfg.consumer_group)
        await dead.ensure_group()
        prompts = RedisStream(self.redis, self.cfg.prompts_stream)
        jobs = self.jobs if self.jobs is not None else load_prompt_jobs(
            self.cfg.dataset, self.tcfg.group_size, self.cfg.sampling, self.cfg.max_turns)
        self.manager = StalenessManager(self.tcfg.batch_prompts, self.tcfg.max_staleness)
        self.ledger = LedgerWriter(ledger_path(self.tcfg.checkpoint_dir))
        self.feeder = PromptFeeder(prompts, jobs, self.manager, epochs=self.tcfg.total_epochs,
                                   ledger=self.ledger)
        self.reader = GroupReader(groups, self.cfg.consumer, self.manager, vocab_size=self.vocab_size,
                                  admitted=self.feeder.admitted)
        self.dead = DeadLetters(dead, self.cfg.consumer)

    def _resume(self) -> int:
        latest = latest_checkpoint(self.tcfg.checkpoint_dir)
        if latest is None:
            if self.rank == 0:
                self.ledger.write("resume", step=0)
            return 0
        meta = load_checkpoint(latest.path, self.actor, self.optimizer, components=self._components())
        if self.rank == 0:
            self.feeder.load_state_dict(meta.extra["feeder"])
            self.reader.load_state_dict(meta.extra["reader"])
            self.ledger.write("resume", step=meta.step)
            note_resumed(meta.step)
        log.info(
            "resumed from %s (step %d, version %d)", latest.path, meta.step, meta.extra["feeder"]["version"]
        )
        return meta.step

    # ---- one step ---------------------------------------------------------------------------
    async def _collect(self) -> Collected | Literal["stop", "used_up"]:
        """The step's groups; ``"stop"`` when a stop was requested before the batch was full,
        ``"used_up"`` when every prompt was admitted and resolved and dropped groups (dynamic
        sampling, staleness) left the batch short: the run ends there, cleanly.

        In both cases the partial batch is released (left pending in Redis, not marked seen), so
        a restarted trainer trains on it instead of dropping it as a duplicate.

        Run as a prefetch (``prefetch.py``) it starts while the previous step's update runs; its
        ``group_wait_s`` deadline only counts from when the loop waits for the batch, as the
        sequential loop's collect starts after the update, validation and checkpoint.
        """
        await self.feeder.top_up()
        keep = None
        if self.tcfg.dynamic_sampling.enabled:

            def keep(g: Group) -> bool:
                return len({t.reward for t in g.trajectories}) > 1

        deadline = time.monotonic() + self.cfg.group_wait_s
        last_group = time.monotonic()
        held = Batch([], [])
        dropped: dict[str, int] = {}
        limit = self.tcfg.dynamic_sampling.max_groups_pulled
        while len(held.groups) < self.tcfg.batch_prompts:
            if self.stop_requested:
                self._release(held)
                log.info("stop requested while waiting for groups; releasing %d held", len(held.groups))
                return "stop"
            if self.feeder.exhausted and self.manager.in_flight(len(held.groups)) <= 0:
                self._release(held)
                log.warning(
                    "the dataset is used up (%d prompt jobs over total_epochs=%d, all resolved) with %d of "
                    "%d groups for the next batch (dropped this batch: %s); ending the run",
                    self.feeder.cursor, self.tcfg.total_epochs, len(held.groups), self.tcfg.batch_prompts,
                    dropped,
                )
                return "used_up"
            pulled = len(held.groups) + sum(dropped.values())
            if limit is not None and pulled >= limit:
                raise RuntimeError(
                    f"dynamic_sampling.max_groups_pulled={limit} reached with only {len(held.groups)} "
                    f"of {self.tcfg.batch_prompts} usable groups (dropped: {dropped})"
                )
            if self._prefetch is not None and not self._prefetch.awaited:  # read ahead, not needed yet
                deadline = time.monotonic() + self.cfg.group_wait_s
            if time.monotonic() > deadline:
                in_flight = self.manager.in_flight(len(held.groups))
                cause = (
                    f"the dataset is used up but {in_flight} admitted jobs never came back: see "
                    f"{self.cfg.prompts_stream}:dead"
                    if self.feeder.exhausted
                    else f"{in_flight} jobs in flight; is a rollout worker consuming "
                    f"{self.cfg.prompts_stream}?"
                )
                raise TimeoutError(
                    f"no full batch within group_wait_s={self.cfg.group_wait_s}: got {len(held.groups)} "
                    f"of {self.tcfg.batch_prompts} groups (dropped: {dropped}; {cause})"
                )
            batch = await self.reader.next_batch(
                self.tcfg.batch_prompts - len(held.groups), keep=keep, block_ms=1000, max_wait_rounds=1
            )
            self._account(batch)
            dead = await self._dead_letters()
            if dead:
                batch.dropped["dead_lettered"] += dead
            if batch.groups or batch.dropped:
                last_group = time.monotonic()
            elif time.monotonic() - last_group > self.cfg.reissue_check_s:
                await self._reissue_vanished()
                last_group = time.monotonic()
            held.groups += batch.groups
            held.message_ids += batch.message_ids
            held.staleness += batch.staleness
            for reason, n in batch.dropped.items():
                dropped[reason] = dropped.get(reason, 0) + n
            if batch.dropped:
                await self.feeder.top_up()  # dropped groups leave admission room unused: refill
        groups, staleness = held.groups, held.staleness
        stats = {f"rollout/dropped_{k}": float(v) for k, v in dropped.items()}
        stats["rollout/staleness_mean"] = sum(staleness) / len(staleness)
        trajs = [t for g in groups for t in g.trajectories]
        stats["rollout/turns_mean"] = sum(t.turns for t in trajs) / len(trajs)
        stats["rollout/tool_calls_mean"] = sum(t.tool_calls for t in trajs) / len(trajs)
        stats["rollout/accuracy"] = sum(bool(t.correct) for t in trajs) / len(trajs)
        stats["rollout/reward_timeouts"] = float(sum(t.reward_reason == "timeout" for t in trajs))
        stats["rollout/tool_use_rate"] = sum(t.tool_calls > 0 for t in trajs) / len(trajs)
        stats.update({f"rollout/{k}": v for k, v in tool_curves(trajs).items() if v is not None})

        stats.update(await queue_stats(self.feeder.stream, self.reader.stream))
        return Collected(rollouts_of(groups, self.cfg.incorrect_reward), stats, held)

    def _release(self, held: Any) -> None:
        """Give back a batch no step used: its jobs are outstanding again (see ``GroupReader.release``)."""
        self.reader.release(held)
        for g in held.groups:
            self.feeder.unresolve(g.job_id)

    def _hold(self, held: Batch) -> None:
        """Take back a batch ``_release``d only for a checkpoint (read ahead of its step)."""
        self.reader.hold(held)
        for g in held.groups:
            self.feeder.resolve(g.job_id)

    async def _prefetched(self) -> Batch | None:
        """Rank 0: the batch read ahead of its step, once the prefetch finished; None if none is held."""
        if self._prefetch is None:
            return None
        got = await self._prefetch.result()
        return got.held if isinstance(got, Collected) else None

    def _release_ahead(self, held: Batch) -> None:
        """A stop: a batch read ahead is released like a partial batch, for the restarted trainer."""
        self._release(held)
        log.info("stop requested: releasing the %d groups read ahead", len(held.groups))

    async def _drop_prefetch(self) -> None:
        """A stop after the update: the batch being read ahead is released (``_release_ahead``)."""
        if (held := await self._prefetched()) is not None:
            self._release_ahead(held)
        self._prefetch = None

    def _account(self, batch: Any) -> None:
        """Ledger and outstanding set for what ``next_batch`` resolved: kept groups, drops, duplicates."""
        for g in batch.groups:
            self.feeder.resolve(g.job_id)
        for job_id, reason in batch.drops:
            self.feeder.resolve(job_id)
            self.ledger.drop(job_id, reason)
        for job_id in batch.duplicates:
            self.ledger.write("duplicate", job_id=job_id)

    async def _dead_letters(self) -> int:
        """Resolve outstanding jobs the rollout fleet dead-lettered; returns how many."""
        n = 0
        for job_id, reason in await self.dead.read():
            if job_id is None or not self.feeder.resolve(job_id):
                log.info("dead letter for no outstanding job ignored", extra={"job_id": job_id})
                continue
            self.reader.remember(job_id)
            self.manager.release(1)
            self.ledger.drop(job_id, "dead_lettered", reason)
            log.warning("prompt job dead-lettered by rollout",
                        extra={"job_id": job_id, "reason": reason[:300]})
            n += 1
        return n

    async def _reissue_vanished(self) -> None:
        vanished = await self.feeder.vanished(self.cfg.groups_stream, self.dead.stream.stream)
        if vanished:
            note_reissued(await self.feeder.reissue(vanished))

    async def _validate(self) -> dict[str, float]:
        """``val_n`` samples per validation prompt through the rollout fleet (reference metric names)."""
        if not self.cfg.val_dataset or self.rank != 0:
            return {}

        rollout_urls = resolve(self.cfg.rollout_urls)  # dns: entries -> one URL per replica
        if not rollout_urls:
            raise ConfigError("rollout_urls: validation needs at least one rollout HTTP URL")
        jobs = load_prompt_jobs(
            self.cfg.val_dataset, self.tcfg.val_n, self.cfg.val_sampling, self.cfg.max_turns
        )
        start = time.perf_counter()
        groups = await rollout_groups(rollout_urls, jobs, concurrency=self.cfg.val_concurrency,
                                      client_kwargs=self.cfg.rollout_security.httpx_kwargs("rollout_security"))
        metrics = compute_validation_metrics(val_samples(jobs, groups), seed=self.tcfg.seed)
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
        on_device = encode_on_device(self.cfg.weight_encode_where, model_device(self.actor), self.world,
                                     self.cfg.weight_transport)
        if self.tcfg.step_mode == "null" and self.tcfg.null_push_mb is not None:  # benchmarks: a set payload
            weights = dict(payload_tensors(self.tcfg.null_push_mb, float(version)))
            on_device = False  # the payload is made on the host
        else:
            weights = full_state_dict(self.actor, on_device=on_device)  # collective
        if self.rank != 0 or not self.cfg.rollout_targets:
            return {}

        if getattr(self, "_pusher", None) is None:
            token = read_secret(self.cfg.weight_token_file, self.cfg.weight_token_env, "weight_token")
            if not token:
                raise ConfigError(
                    f"weight_token_env: environment variable {self.cfg.weight_token_env} is not set"
                )
            # one per run: it keeps the last pushed weights (deltas) and what each replica acknowledged
            self._pusher = WeightPusher(
                self.cfg.rollout_targets, token, bucket_bytes=self.cfg.weight_bucket_mb * 2**20,
                transport=self.cfg.weight_transport, delta=self.cfg.weight_delta, dtype=self.cfg.weight_dtype,
                wait_s=self.cfg.weight_push_wait_s, security=ChannelSecurity.from_files(self.cfg.weight_tls),
                encode_where="device" if on_device else "host",
            )
        # dns: targets resolve to every replica on each push; failed attempts are retried and counted
        return await self._pusher.push(weights, version)

    async def _checkpoint(self, step: int) -> None:
        """Save ``step``, then acknowledge the groups the steps since the last save used.

        Never a batch read ahead (``prefetch.py``): the checkpoint waits for the prefetch, releases
        its batch for the state and the commit (its jobs outstanding, its groups unseen and pending
        in Redis, as for a partial batch) and holds it again after, for the next step."""
        ahead = await self._prefetched() if self.rank == 0 else None
        if ahead is not None:
            self._release(ahead)
        extra = (
            {"feeder": self.feeder.state_dict(), "reader": self.reader.state_dict()} if self.rank == 0 else {}
        )
        extra = self._broadcast(extra)
        if self.rank == 0:  # before the save: the ledger's state here is what the checkpoint holds
            self.ledger.write("checkpoint", step=step)
        save_checkpoint(
            self.tcfg.checkpoint_dir,
            step,
            self.actor,
            self.optimizer,
            keep_last=self.tcfg.keep_last_checkpoints,
            extra=extra,
            components=self._components(),
        )
        if self.rank == 0:
            await self.reader.commit()
            await self.dead.commit()
            if ahead is not None:
                self._hold(ahead)

    def _train_in_thread(self, rollouts: list[Rollout], step: int) -> dict[str, float]:
        """``_train`` in a worker thread (the overlapped feed): the CUDA device is per thread."""
        device = model_device(self.actor)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return self._train(rollouts, step)

    def _train(self, rollouts: list[Rollout], step: int) -> dict[str, float]:
        """The FSDP step on one batch (collective: every rank); returns its metrics."""
        samples, batch_metrics = build_samples(
            rollouts,
            norm_by_std=self.tcfg.norm_adv_by_std,
            overlong=self.tcfg.overlong,
            max_response_len=self.tcfg.max_response_len,
        )
        settings, dp = StepSettings.from_config(self.tcfg), DPInfo(self.rank, self.world)
        if self.critic is not None and self.critic_optimizer is not None:
            step_metrics = ppo_train_step(
                self.actor, self.optimizer, self.critic, self.critic_optimizer, samples, settings,
                CriticSettings.from_config(self.tcfg.critic), dp,
                update_actor=step >= self.tcfg.critic.warmup_steps,
            )
        else:
            step_metrics = train_step(self.actor, self.optimizer, samples, settings, dp)
        return {**batch_metrics, **step_metrics}

    async def _record(self, metrics: dict[str, float], total: int) -> None:
        """Rank 0, after step ``self.step`` trained and pushed: admission, metrics, ledger, audit log."""
        self.manager.advance(self.version)
        if self.step % self.tcfg.test_freq == 0 or self.step >= total:
            metrics.update(await self._validate())
        self.sink.write(self.step, metrics)
        self.ledger.trained(self.step, self._last_job_ids)
        if self.cfg.groups_log:
            with open(self.cfg.groups_log, "a") as fh:
                fh.write(json.dumps({"step": self.step, "job_ids": self._last_job_ids}) + "\n")

    def _after_step(self, step: int) -> None:
        """Between a step's record and its checkpoint: the fault-injection point (tests)."""
        if os.environ.get(FAULT_KILL_AFTER_STEP) == str(step):  # a hard crash, like an OOM kill
            os.kill(os.getpid(), signal.SIGKILL)

    async def _next_batch(self) -> Collected | Literal["stop", "used_up"]:
        """Rank 0: the step's batch, read ahead during the last update or collected now, with
        ``perf/feed_overlap_seconds`` (read while the update ran) and ``perf/feed_wait_seconds``
        (still waited for after it). A stop requested before a batch read ahead was handed out
        releases it (as ``_collect`` releases a partial one)."""
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is None:
            start = time.perf_counter()
            got = await self._collect()
            waited = time.perf_counter() - start
            timings = {"perf/feed_overlap_seconds": 0.0, "perf/feed_wait_seconds": waited}
        else:
            got = await prefetch.result()
            timings = prefetch.timings()
            if isinstance(got, Collected) and self.stop_requested:
                self._release_ahead(got.held)
                return "stop"
        if isinstance(got, Collected):
            got.stats.update(timings)
        return got

    async def step_once(self, total: int) -> StepOutcome:
        """One step on every rank: collect a batch (rank 0), train, push the weights, record
        (rank 0: admission, metrics, ledger), checkpoint every ``save_freq`` steps, at the last
        planned step ``total`` and on a stop (then commit the groups used).

        With ``trainer.feed_overlap`` the update runs in a worker thread while rank 0 reads the
        next step's batch (``prefetch.py``), except at the last planned step.

        ``"stopped"``: a stop was requested (while waiting for groups, or during the step) and a
        checkpoint written; ``"used_up"``: the data is used up before the batch was full
        (checkpoint written); ``"trained"``: ``self.step`` advanced by one."""
        start = time.perf_counter()
        got = await self._next_batch() if self.rank == 0 else None
        payload = self._broadcast((got.rollouts, got.stats) if isinstance(got, Collected) else got)
        if payload == "stop":  # stopped while waiting for groups: checkpoint the last finished step
            await self._checkpoint(self.step)
            log.info("SIGTERM: checkpoint written at step %d, exiting", self.step)
            return "stopped"
        if payload == "used_up":  # drops used the data up before the planned steps: end cleanly
            await self._checkpoint(self.step)
            log.warning("data used up at step %d of %d planned; checkpoint written", self.step, total)
            return "used_up"
        rollouts, stats = payload
        overlap = self.tcfg.feed_overlap
        if isinstance(got, Collected):  # rank 0
            self._last_job_ids = [g.job_id for g in got.held.groups]
            if overlap and self.step + 1 < total:
                self.manager.begin_update()  # the batch read now is judged at the version after this step
                self._prefetch = Prefetch(self._collect)
        if overlap:
            metrics = await asyncio.to_thread(self._train_in_thread, rollouts, self.step)
        else:
            metrics = self._train(rollouts, self.step)
        self.version += 1
        push = await self._push(self.version)
        self.step += 1
        if self.rank == 0:
            await self._record({**stats, **metrics, **push, "policy/version": float(self.version),
                                "perf/step_seconds": time.perf_counter() - start}, total)
            if self._prefetch is not None:
                await self.feeder.top_up()  # at the new version: what the sequential next collect starts with
                if self.manager.settle():  # drops read during the update, released as after that top-up
                    await self.feeder.top_up()
                self._prefetch.end_update()
        self._after_step(self.step)
        stop = self._broadcast(self.stop_requested)
        if stop and self.rank == 0:
            await self._drop_prefetch()
        if self.step % self.tcfg.save_freq == 0 or stop or self.step >= total:
            await self._checkpoint(self.step)
        if stop:
            log.info("SIGTERM: checkpoint written at step %d, exiting", self.step)
            return "stopped"
        return "trained"

    async def run(self) -> int:
        self._setup_model()
        return await self.train()

    async def train(self) -> int:
        """Everything after the model is set up: streams and resume, then ``step_once`` until the
        end; returns the last step. SIGTERM requests a stop (checkpoint, then return)."""
        previous = signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop_requested", True))
        try:
            return await self._train_loop()
        finally:
            if self._prefetch is not None:  # only on an error: what it read stays pending in Redis
                await self._prefetch.cancel()
                self._prefetch = None
            signal.signal(signal.SIGTERM, previous)

    async def _train_loop(self) -> int:
        if self.rank == 0:
            await self._setup_streams()
            trackers = open_trackers(self.cfg.tracking, self.cfg.model_dump(mode="json"))
            self.sink = MetricsSink(self.cfg.metrics_path, self.cfg.metrics_port, self.tcfg.max_staleness,
                                    trackers=trackers, host=self.cfg.metrics_host)
        else:
            self.feeder = self.reader = None  # type: ignore[assignment]
        self.step = self._resume()
        self.version = self._broadcast(self.manager.version if self.rank == 0 else 0)
        total = self._broadcast(
            planned_steps(self.cfg.max_steps, len(self.feeder.dataset), self.tcfg.total_epochs,
                          self.tcfg.batch_prompts)
            if self.rank == 0
            else 0
        )
        bar = tqdm(total=total, initial=self.step, desc="train", disable=self.rank != 0)
        first = self.step == 0 and self.tcfg.val_before_train and self.rank == 0
        if first and (val := await self._validate()):
            self.sink.write(0, val)
        outcome: StepOutcome = "trained"
        while self.step < total and outcome == "trained":
            before = self.step
            outcome = await self.step_once(total)
            bar.update(self.step - before)
        ended = outcome != "stopped" or self.step >= total
        bar.close()
        if (pusher := getattr(self, "_pusher", None)) is not None:
            pusher.close()  # the delta encoder's threads
        if self.rank == 0:
            if ended:
                self.ledger.write("end", step=self.step, outstanding=self.manager.in_flight(0))
            self.ledger.close()
            self.sink.close()
            await self.redis.aclose()
        if dist.is_initialized():
            dist.barrier()  # every rank is past its last collective before gloo/NCCL is torn down
            dist.destroy_process_group()
        return self.step
