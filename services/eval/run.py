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

from tqdm import tqdm

from services.common.config import ConfigError
from services.common.process import ServiceProcess
from services.common.schemas import Group, PromptJob, RolloutSampling
from services.data.prompt_jobs import load_prompt_jobs
from services.eval.metrics import reference_metrics, summarize
from services.eval.report import markdown, plot_curves, plot_distributions
from services.eval.schemas import EvalConfig, EvalReport
from services.stack.local import start_tool_services
from services.transport.rollout.client import rollout_groups


def _jobs(cfg: EvalConfig) -> list[PromptJob]:
    sampling = RolloutSampling(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                               seed=cfg.seed)
    jobs = load_prompt_jobs(cfg.data, cfg.n, sampling, cfg.max_turns)
    return jobs[: cfg.limit] if cfg.limit else jobs


def _start_local_rollout(stack: contextlib.ExitStack, cfg: EvalConfig, out: Path) -> str:
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
