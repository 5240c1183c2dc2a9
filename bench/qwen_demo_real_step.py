"""Seconds of one ``retool demo --tokenizer qwen2.5`` SFT step and GRPO trainer step, on the demo's
own code path: the demo's data and model (``Demo.prepare_data``, ``Demo.init_model``: 151,936 tied
rows), its SFT config and runner (``SFTRunner.train_batch`` on the demo's batches of 32 traces), and
``train_step`` (old-log-prob recompute, forward, backward, AdamW) on 64 samples shaped as the demo's
GRPO batch (a 39-token prompt of a real trace + 48 response tokens, loss mask on the response;
the response ids are random: the cost does not depend on them). One torch thread, as the demo.
``--profile`` prints torch.profiler's table for the last step. The rollout, weight push and
evaluation are not timed here (the demo's ``metrics.jsonl`` has them).

    PYTHONPATH=$PWD .venv/bin/python bench/qwen_demo_real_step.py --steps 4
    PYTHONPATH=$PWD .venv/bin/python bench/qwen_demo_real_step.py --phase sft --steps 3 --profile

For a before/after figure, run the same file with ``PYTHONPATH`` set to an older tree's copy of
``services`` (``git archive <commit> services | tar -x -C /tmp/old``), back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

PROMPT, RESPONSE, GROUPS = 39, 48, 64


def _timed(fn: Any, profile: bool) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``; with ``profile``, torch.profiler's table printed too."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    start = time.perf_counter()
    if prof is None:
        out = fn()
    else:
        with prof:
            out = fn()
    seconds = time.perf_counter() - start
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    return seconds, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["sft", "grpo", "both"], default="both")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of the last step")
    ap.add_argument("--work-dir", default="/tmp/qwen-demo-bench", help="the demo's data and initial model")
    args = ap.parse_args()
    from services.demo.pipeline import Demo, DemoConfig
    from services.trainer.packing import TrainSample
    from services.trainer.sft.data import batch_indices
    from services.trainer.sft.run import SFTRunner
    from services.trainer.step import StepSettings, train_step

    torch.set_num_threads(1)  # the demo's torch_threads
    out = Path(args.work_dir)
    demo = Demo(DemoConfig(out_dir=str(out), tokenizer="qwen2.5"))
    out.mkdir(parents=True, exist_ok=True)
    demo.prepare_data()
    init = out / "model" / "init"
    if not (init / "config.json").exists():
        init = demo.init_model()
    runner = SFTRunner(demo.sft_config(init))
    runner._load_data()
    runner._setup_model(None)
    load = os.getloadavg()
    print(json.dumps({"loadavg_start": [round(x, 2) for x in load]}), flush=True)
    if args.phase in ("sft", "both"):
        for i in range(args.steps):
            idx = batch_indices(len(runner.samples), 0, i, demo.cfg.sft.batch_size, demo.cfg.seed, True)
            batch = [runner.samples[j] for j in idx]
            seconds, o = _timed(lambda b=batch: runner.train_batch(b), args.profile and i == args.steps - 1)
            print(json.dumps({"phase": "sft", "step": i, "seconds": round(seconds, 2), "loss": o["loss"],
                              "tokens": o["tokens"], "loss_tokens": o["loss_tokens"]}), flush=True)
    if args.phase in ("grpo", "both"):
        runner.actor.entropy = True  # the RL trainer's actor computes the entropy (a metric); SFT's does not
        gen = torch.Generator().manual_seed(0)
        samples = []
        for s in runner.samples[:GROUPS]:
            ids = torch.cat([s.input_ids[:PROMPT], torch.randint(0, 151_643, (RESPONSE,), generator=gen)])
            mask = torch.zeros(len(ids))
            mask[PROMPT:] = 1
            adv = mask * torch.randn(1, generator=gen)
            samples.append(TrainSample(input_ids=ids, loss_mask=mask, advantages=adv,
                                       rollout_logprobs=-torch.rand(len(ids), generator=gen) * mask))
        settings = StepSettings(mini_batch_size=GROUPS, micro_batch_max_tokens=2048)  # the demo's
        for i in range(args.steps):
            seconds, m = _timed(lambda: train_step(runner.actor, runner.optimizer, samples, settings),
                                args.profile and i == args.steps - 1)
            print(json.dumps({"phase": "grpo_trainer", "step": i, "seconds": round(seconds, 2),
                              "pg_loss": m.get("actor/pg_loss"), "grad_norm": m["actor/grad_norm"]}),
                  flush=True)
    print(json.dumps({"loadavg_end": [round(x, 2) for x in os.getloadavg()]}), flush=True)


if __name__ == "__main__":
    main()
