"""``retool eval``: N responses per prompt of an RL/validation parquet through rollout replicas.

Phases: load the prompts (``services.data.prompt_jobs``: row ``k`` samples with seed
``seed + 7919 * k``, so two evaluations of the same weights draw the same random numbers);
when no rollout URL is given start sandbox, reward and a rollout service on ``model`` as local
child processes (stopped on exit, Ctrl-C included); send every prompt with ``n`` samples; score
with the reference's metric names plus tool-use statistics; write ``report.json``,
``report.md``, ``samples.jsonl`` (one line per response) and two PNG plots under ``out_dir``.
Impossible settings are a ``ConfigError`` before anything starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

from pydantic import Field, model_validator

from services.common.config import ConfigError, StrictModel
from services.common.schemas import Group, PromptJob, RolloutSampling
from services.eval.metrics import EvalSummary, reference_metrics, summarize


class EvalConfig(StrictModel):
    data: str = Field(description="parquet with prompt / reward_model.ground_truth / data_source columns")
    model: str | None = Field(None, description="HF model directory served by a local rollout service")
    rollout_urls: list[str] = Field(default_factory=list,
                                    description="running rollout replicas; empty = start one locally")
    n: int = Field(30, ge=1, le=1024, description="responses per prompt")
    limit: int | None = Field(None, ge=1, description="evaluate only the first LIMIT prompts")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(0.6, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, description="response budget; unset = the service's default")
    max_turns: int | None = Field(None, ge=0, description="tool calls per response; unset = the service's")
    seed: int | None = 0
    concurrency: int = Field(16, ge=1, description="prompts in flight")
    n_bootstrap: int = Field(1000, ge=1)
    out_dir: str = "runs/eval"
    rollout_args: list[str] = Field(default_factory=list,
                                    description="extra `retool rollout serve` args (local service)")
    startup_timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _where(self) -> EvalConfig:
        if not self.rollout_urls and not self.model:
            raise ValueError("give either 'model' (a local rollout service is started) or 'rollout_urls'")
        if self.rollout_urls and self.model:
            raise ValueError("give 'model' or 'rollout_urls', not both (a running service has its own model)")
        if not Path(self.data).is_file():
            raise ValueError(f"data: file {self.data} does not exist")
        if self.model and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model} is not a Hugging Face model directory (no config.json)")
        return self


class EvalReport(StrictModel):
    config: EvalConfig
    summary: EvalSummary
    metrics: dict[str, float] = Field(description="reference names: val-core/<source>/acc/mean@N, …")
    wall_seconds: float


def _jobs(cfg: EvalConfig) -> list[PromptJob]:
    from services.data.prompt_jobs import load_prompt_jobs

    sampling = RolloutSampling(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                               seed=cfg.seed)
    jobs = load_prompt_jobs(cfg.data, cfg.n, sampling, cfg.max_turns)
    return jobs[: cfg.limit] if cfg.limit else jobs


def _start_local_rollout(stack: contextlib.ExitStack, cfg: EvalConfig, out: Path) -> str:
    from services.common.local_stack import start_tool_services
    from services.common.process import ServiceProcess

    logs = out / "logs"
    sandbox_url, reward_url = start_tool_services(stack, logs)
    rollout = stack.enter_context(ServiceProcess(
        ["rollout", "serve", "--model", str(cfg.model), "--sandbox-url", sandbox_url,
         "--reward-url", reward_url, *cfg.rollout_args],
        log_path=logs / "rollout.log", startup_timeout_s=cfg.startup_timeout_s))
    print(f"rollout  {rollout.url} ({cfg.model})", file=sys.stderr)
    return rollout.url


async def collect_groups(urls: list[str], jobs: list[PromptJob], concurrency: int, desc: str = "eval"
                         ) -> list[Group]:
    """``groups[i]`` answers ``jobs[i]``; a progress bar shows accuracy and tool use so far."""
    from tqdm import tqdm

    from services.rollout.http_client import rollout_groups

    bar = tqdm(total=len(jobs), desc=desc, unit="prompt")
    stats = {"correct": 0, "tool": 0, "responses": 0}

    def progress(_: PromptJob, group: Group) -> None:
        stats["correct"] += sum(bool(t.correct) for t in group.trajectories)
        stats["tool"] += sum(t.tool_calls > 0 for t in group.trajectories)
        stats["responses"] += len(group.trajectories)
        bar.update(1)
        bar.set_postfix(acc=f"{stats['correct'] / stats['responses']:.3f}",
                        tool=f"{stats['tool'] / stats['responses']:.2f}")

    try:
        return await rollout_groups(urls, jobs, concurrency=concurrency, on_group=progress)
    finally:
        bar.close()


def write_outputs(report: EvalReport, jobs: list[PromptJob], groups: list[Group], out: Path) -> None:
    from services.eval.report import markdown, plot_curves, plot_distributions

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(report.model_dump_json(indent=2))
    (out / "report.md").write_text(markdown(report))
    with (out / "samples.jsonl").open("w") as fh:
        for job, group in zip(jobs, groups, strict=True):
            for t in group.trajectories:
                fh.write(json.dumps({
                    "job_id": job.job_id, "data_source": job.data_source, "index": t.index,
                    "ground_truth": job.ground_truth, "extracted": t.extracted, "correct": t.correct,
                    "reward": t.reward, "turns": t.turns, "tool_calls": t.tool_calls,
                    "tool_errors": t.tool_errors, "finish_reason": t.finish_reason,
                    "response_tokens": len(t.response_ids), "response_text": t.response_text,
                }) + "\n")
    trajs = [t for g in groups for t in g.trajectories]
    plot_curves(report, out / "accuracy_at_k.png")
    plot_distributions([t.turns for t in trajs], [len(t.response_ids) for t in trajs],
                       out / "distributions.png")


def evaluate(cfg: EvalConfig) -> EvalReport:
    start = time.monotonic()
    out = Path(cfg.out_dir)
    jobs = _jobs(cfg)
    if not jobs:
        raise ConfigError(f"data: {cfg.data} has no prompts")
    with contextlib.ExitStack() as stack:
        urls = list(cfg.rollout_urls) or [_start_local_rollout(stack, cfg, out)]
        groups = asyncio.run(collect_groups(urls, jobs, cfg.concurrency))
    report = EvalReport(
        config=cfg,
        summary=summarize(groups),
        metrics=reference_metrics(jobs, groups, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed or 0),
        wall_seconds=round(time.monotonic() - start, 2),
    )
    write_outputs(report, jobs, groups, out)
    return report
