"""The trainer section's worker, one rank under torchrun: the trainer's own step code under FSDP2.

Run by ``bench.gpu.trainer`` as ``torchrun --standalone --nproc_per_node 1 -m bench.gpu.trainer_worker``.
It uses what ``retool trainer run`` uses for a step (``init_distributed``: NCCL on CUDA, gloo on the
CPU; ``Actor``; ``apply_fsdp2``; ``build_optimizer``; ``train_step`` with ``StepSettings.from_config``),
without the Redis streams and rollouts around it.

1. reference: one step of the ``reference_preset`` on the CPU in fp32 without FSDP (the reference),
   then the same step from the same weights and samples under FSDP2 on the device in fp32 and in
   bf16; the policy loss and the gradient norm must agree within the tolerances below.
   The rollout log-probs are the reference model's own plus noise, so the importance ratios (and the
   loss) depend on the model.
2. throughput per preset: FSDP2 with bf16 compute and fp32 master weights, gradient checkpointing
   on (the trainer's defaults), packed micro-batches: one warm-up step, then ``trainer_steps`` timed
   optimizer steps over ``trainer_tokens`` real tokens; tokens/s, MFU, peak memory.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu.common import (
    SIZES,
    Ctx,
    bf16_peak_tflops,
    build_lm,
    model_flops,
    peak_rss_gib,
    rl_lengths,
    sync,
    train_samples,
)

# |pg_loss difference| (absolute: advantages are ±1) and relative grad-norm difference vs the CPU fp32 step
TOLERANCE = {"fp32": {"pg_loss": 1e-3, "grad_norm": 1e-2}, "bf16": {"pg_loss": 3e-2, "grad_norm": 0.1}}


def _config(sizes: Any, n: int, param_dtype: str, lr: float = 1e-4) -> Any:
    from services.trainer.config import FSDPConfig, TrainerConfig

    longest = sizes.micro_batch_tokens
    return TrainerConfig(
        batch_prompts=1,
        group_size=max(n, 2),
        mini_batch_size=max(n, 2),
        lr=lr,
        micro_batch_max_tokens=longest,
        max_prompt_len=longest // 2,
        max_response_len=longest - longest // 2,
        recompute_old_logprobs=False,
        fsdp=FSDPConfig(param_dtype=param_dtype),
    )


def _step(lm: torch.nn.Module, samples: list[Any], cfg: Any, fsdp: bool, mesh: Any) -> dict[str, float]:
    from services.trainer.actor import Actor
    from services.trainer.fsdp import apply_fsdp2, build_optimizer
    from services.trainer.step import StepSettings, train_step

    actor = Actor(lm, chunk_tokens=cfg.logprob_chunk_tokens)
    if fsdp:
        apply_fsdp2(actor, cfg.fsdp, mesh)
    opt = build_optimizer(actor, cfg)
    settings = replace(StepSettings.from_config(cfg), mini_batch_size=len(samples))
    return train_step(actor, opt, samples, settings)


def reference(ctx: Ctx, mesh: Any) -> dict[str, Any]:
    from services.trainer.actor import Actor
    from services.trainer.packing import pack

    sizes = ctx.sizes
    preset = sizes.reference_preset
    lm = build_lm(preset, "cpu", seed=0)
    lengths = rl_lengths(sizes.micro_batch_tokens, sizes.length_scale, seed=1)[:8]
    samples = train_samples(lengths, lm.config.vocab_size, seed=1)
    with torch.no_grad():  # rollout log-probs near the model's own: ratios around 1, some clipped
        mb = pack(samples)
        lp, _ = Actor(lm).eval()(mb.input_ids, mb.position_ids, None)
        gen = torch.Generator().manual_seed(2)
        parts = torch.split(lp[0], lengths)
        samples = [
            replace(s, rollout_logprobs=p + 0.3 * torch.randn(p.shape, generator=gen))
            for s, p in zip(samples, parts, strict=True)
        ]
    out: dict[str, Any] = {
        "preset": preset,
        "sequences": len(samples),
        "tokens": sum(lengths),
        "tolerance": TOLERANCE,
    }
    ref = _step(copy.deepcopy(lm), samples, _config(sizes, len(samples), "fp32"), fsdp=False, mesh=None)
    out["cpu_fp32"] = {"pg_loss": ref["actor/pg_loss"], "grad_norm": ref["actor/grad_norm"]}
    ok = True
    for dtype in ("fp32", "bf16"):
        got = _step(copy.deepcopy(lm), samples, _config(sizes, len(samples), dtype), fsdp=True, mesh=mesh)
        d_pg = abs(got["actor/pg_loss"] - ref["actor/pg_loss"])
        d_gn = abs(got["actor/grad_norm"] - ref["actor/grad_norm"]) / max(abs(ref["actor/grad_norm"]), 1e-12)
        passed = d_pg <= TOLERANCE[dtype]["pg_loss"] and d_gn <= TOLERANCE[dtype]["grad_norm"]
        ok = ok and passed
        out[f"{ctx.device}_fsdp_{dtype}"] = {
            "pg_loss": got["actor/pg_loss"],
            "grad_norm": got["actor/grad_norm"],
            "pg_loss_abs_diff": d_pg,
            "grad_norm_rel_diff": d_gn,
            "passed": passed,
        }
    out["passed"] = ok
    return out


def throughput(ctx: Ctx, preset: str, mesh: Any) -> dict[str, Any]:
    from services.trainer.actor import Actor
    from services.trainer.fsdp import apply_fsdp2, build_optimizer
    from services.trainer.step import StepSettings, train_step

    sizes, dev = ctx.sizes, ctx.device
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    lm = build_lm(preset, dev, seed=0)
    n_params = sum(p.numel() for p in lm.parameters())
    lengths = rl_lengths(sizes.trainer_tokens, sizes.length_scale, seed=3)
    samples = train_samples(lengths, lm.config.vocab_size, seed=3)
    cfg = _config(sizes, len(samples), "bf16", lr=1e-6)
    actor = apply_fsdp2(Actor(lm, chunk_tokens=cfg.logprob_chunk_tokens), cfg.fsdp, mesh)
    opt = build_optimizer(actor, cfg)
    settings = replace(StepSettings.from_config(cfg), mini_batch_size=len(samples))
    build_s = time.perf_counter() - t0
    seconds = []
    metrics: dict[str, float] = {}
    for i in range(sizes.trainer_steps + 1):  # step 0 warms up (allocator, kernels) and is not timed
        sync(dev)
        t0 = time.perf_counter()
        metrics = train_step(actor, opt, samples, settings)
        sync(dev)
        if i:
            seconds.append(time.perf_counter() - t0)
        if ctx.left() < 0:
            break
    step_s = statistics.median(seconds) if seconds else float("nan")
    tokens = sum(lengths)
    flops = model_flops(preset, lengths)
    peak = bf16_peak_tflops(torch.cuda.get_device_name(0)) if dev == "cuda" else None
    out = {
        "preset": preset,
        "parameters": n_params,
        "param_dtype": "bf16",
        "sequences": len(lengths),
        "tokens_per_step": tokens,
        "micro_batch_tokens": sizes.micro_batch_tokens,
        "optimizer_steps_per_step": metrics.get("actor/optimizer_steps"),
        "timed_steps": len(seconds),
        "step_seconds": seconds,
        "median_step_seconds": step_s,
        "tokens_per_s": tokens / step_s,
        "model_tflops_per_step": flops / 1e12,
        "achieved_tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / 1e12 / peak if peak else None,
        "bf16_peak_tflops": peak,
        "pg_loss": metrics.get("actor/pg_loss"),
        "grad_norm": metrics.get("actor/grad_norm"),
        "build_seconds": build_s,
    }
    if dev == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_memory_kind"] = "torch.cuda.max_memory_allocated"
    else:
        out["peak_memory_gib"] = peak_rss_gib()
        out["peak_memory_kind"] = "peak RSS of the worker process (all runs so far)"
    del actor, opt, lm
    return out


def _watchdog(deadline: float) -> None:
    """Exit hard at ``deadline``: torchrun starts this worker in a session of its own, so the check
    killing the section's process group would not reach it (and it would hold the GPU)."""

    def wait() -> None:
        time.sleep(max(0.0, deadline - time.time()))
        sys.stderr.write("trainer worker: deadline reached, exiting\n")
        sys.stderr.flush()
        os._exit(124)

    threading.Thread(target=wait, daemon=True, name="deadline").start()


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:400]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=sorted(SIZES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, required=True, help="time.time() to be done by")
    args = ap.parse_args()
    _watchdog(args.deadline)
    from services.trainer.config import TrainerConfig
    from services.trainer.fsdp import init_distributed

    ctx = Ctx(args.device, args.out.parent, args.out, args.deadline)
    if (args.device == "cuda") != torch.cuda.is_available():
        raise SystemExit(
            f"--device {args.device} but torch.cuda.is_available() is {torch.cuda.is_available()}"
        )
    _rank, world, mesh = init_distributed(TrainerConfig(mini_batch_size=2, batch_prompts=1, group_size=2))
    import torch.distributed as dist

    ctx.save(backend=dist.get_backend(), world_size=world)
    try:
        ctx.save(reference=reference(ctx, mesh))
    except Exception as exc:  # recorded; the throughput runs still go
        ctx.save(reference={"error": _error(exc), "passed": False})
    runs = []
    for preset in ctx.sizes.trainer_presets:
        if ctx.left() < 10:
            runs.append({"preset": preset, "error": "skipped: out of time"})
            break
        try:
            runs.append(throughput(ctx, preset, mesh))
        except Exception as exc:  # e.g. out of memory on a smaller card: recorded, the next preset runs
            runs.append({"preset": preset, "error": _error(exc)})
        ctx.save(runs=runs)
    ctx.save(runs=runs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
