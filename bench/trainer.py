"""Trainer throughput: padding-free packed micro-batches vs padded micro-batches, same run.

Same tiny Qwen2 (random init, CPU), same sequences (RL-like length mix: prompts 64-256 tokens,
responses lognormal, clipped to 50..2000), same number of optimizer steps, same loss, same
``train_step`` code. Two padded baselines, 4 sequences per micro-batch in arrival order:
``padded-batch`` pads every row to the batch's longest sequence (the fixed-shape layout of an RL
batch in verl without remove-padding; verl would pad to the *configured* max lengths, slower
still) and ``padded-micro`` pads each micro-batch only to its own longest sequence (generous).
tokens/s = real (non-pad) tokens per optimizer step / step time (fwd + bwd + optimizer), reported
for the median and the best step; steps of the three arms are interleaved so the (shared, noisy)
machine slows all arms alike.
The final weights of all arms are compared (they must agree: same math, different layout).

    .venv/bin/python bench/trainer.py --quick      # < 2 minutes on 2 busy cores
    .venv/bin/python bench/trainer.py              # larger model and batch
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.packing import TrainSample, pack, plan_micro_batches
from services.trainer.step import StepSettings, train_step


def make_samples(n: int, vocab: int, seed: int) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = int(rng.integers(64, 257))
        resp = int(np.clip(rng.lognormal(mean=5.8, sigma=0.9), 50, 2000))
        length = prompt + resp
        ids = torch.from_numpy(rng.integers(0, vocab, size=length)).long()
        mask = torch.zeros(length)
        mask[prompt:] = 1
        adv = mask * float(rng.choice([-1.0, 1.0]))
        rollout = torch.from_numpy(-rng.random(length) * 2).float()
        out.append(TrainSample(input_ids=ids, loss_mask=mask, advantages=adv, rollout_logprobs=rollout))
    return out


@dataclass
class Arm:
    mode: str
    actor: Actor
    opt: torch.optim.Optimizer
    settings: StepSettings
    init: dict[str, torch.Tensor]
    step_seconds: list[float] = field(default_factory=list)


def make_arm(mode: str, samples: list[TrainSample], args: argparse.Namespace) -> Arm:
    width = max(len(s) for s in samples) if mode == "padded-batch" else None
    actor = Actor(tiny_qwen2(hidden=args.hidden, layers=args.layers, vocab=args.vocab, heads=4, kv_heads=2,
                             seed=0), chunk_tokens=2048)
    init = {k: v.detach().clone() for k, v in actor.named_parameters()}
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-3)  # large enough that the weight check means something
    if mode == "packed":
        settings = StepSettings(mini_batch_size=len(samples), micro_batch_max_tokens=args.token_budget,
                                use_packing=True, recompute_old_logprobs=False)
    else:
        # padded: micro-batches of a fixed number of sequences in arrival order, every row padded
        # to the batch's longest sequence ("padded-batch": verl's fixed-shape layout without
        # remove-padding) or only to the micro-batch's longest ("padded-micro": generous baseline).
        settings = StepSettings(mini_batch_size=len(samples), micro_batch_max_tokens=10**9, use_packing=False,
                                padded_micro_batch_size=args.padded_micro, pad_to_length=width,
                                recompute_old_logprobs=False)
    warm = samples[: args.padded_micro]
    train_step(actor, opt, warm, replace(settings, mini_batch_size=len(warm)))  # warm-up (not timed)
    return Arm(mode, actor, opt, settings, init)


def run_interleaved(arms: list[Arm], samples: list[TrainSample], steps: int) -> None:
    """Steps alternate between arms (rotating the order) so machine noise hits all arms alike."""
    for step in range(steps):
        for j in range(len(arms)):
            arm = arms[(step + j) % len(arms)]
            t0 = time.perf_counter()
            train_step(arm.actor, arm.opt, samples, arm.settings)
            arm.step_seconds.append(time.perf_counter() - t0)


def compare_attention(samples: list[TrainSample], args: argparse.Namespace, reps: int = 3) -> dict[str, Any]:
    """Forward+backward of one packed micro-batch under each attention implementation."""
    micro = plan_micro_batches([len(s) for s in samples], args.token_budget)[0]
    mb = pack([samples[i] for i in micro])
    out: dict[str, Any] = {"tokens": mb.computed_tokens, "sequences": mb.num_seqs}
    ref = None
    variants = (("varlen (ours)", "sdpa", True), ("sdpa + block mask", "sdpa", False),
                ("eager + block mask", "eager", False), ("flex_attention", "flex_attention", False))
    for name, impl, varlen in variants:
        try:
            actor = Actor(tiny_qwen2(hidden=args.hidden, layers=args.layers, vocab=args.vocab, seed=0,
                                     attn_implementation=impl), varlen_packed=varlen)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                lp, _ = actor(mb.input_ids, mb.position_ids, None)
                lp.sum().backward()
                times.append(time.perf_counter() - t0)
            ref = lp.detach() if ref is None else ref
            diff = (lp.detach() - ref).abs().max().item()
            out[name] = {"best_s": min(times), "max_logprob_diff_vs_varlen": diff}
            print(f"  attention {name:>20}: {min(times):.3f} s fwd+bwd (best of {reps}), "
                  f"max |Δ log-prob| vs varlen {diff:.1e}")
        except Exception as exc:  # e.g. flex_attention has no CPU backward
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            print(f"  attention {name:>20}: unavailable ({type(exc).__name__}: {str(exc)[:90]})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seqs", type=int, default=48)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--padded-micro", type=int, default=4, help="sequences per padded micro-batch")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    args = ap.parse_args()
    if args.quick:
        args.seqs, args.steps, args.hidden, args.layers, args.vocab = 24, 5, 64, 2, 1024
    torch.manual_seed(0)
    samples = make_samples(args.seqs, args.vocab, seed=1)
    lengths = [len(s) for s in samples]
    print(f"{len(samples)} sequences, {sum(lengths)} real tokens, lengths min/median/max = "
          f"{min(lengths)}/{int(np.median(lengths))}/{max(lengths)}; {args.steps} optimizer steps each; "
          f"torch threads={torch.get_num_threads()}")
    real_tokens = sum(lengths)
    print(f"attention over one packed micro-batch ({args.token_budget}-token budget):")
    attention = compare_attention(samples, args)
    arms = [make_arm(mode, samples, args) for mode in ("padded-batch", "padded-micro", "packed")]
    run_interleaved(arms, samples, args.steps)
    results: dict[str, dict[str, Any]] = {}
    for arm in arms:
        median = statistics.median(arm.step_seconds)
        best = min(arm.step_seconds)
        params = {k: v.detach().clone() for k, v in arm.actor.named_parameters()}
        results[arm.mode] = {"tokens_per_s": real_tokens / median, "best_tokens_per_s": real_tokens / best,
                             "median_step_s": median,
                             "step_seconds": arm.step_seconds, "params": params,
                             "moved": max((params[k] - arm.init[k]).abs().max().item() for k in params)}
        print(f"{arm.mode:>12}: {real_tokens / median:8.0f} tokens/s median, {real_tokens / best:8.0f} best "
              f"(steps s: "
              f"{', '.join(f'{x:.2f}' for x in arm.step_seconds)})", flush=True)
    packed = results["packed"]
    baselines = ("padded-batch", "padded-micro")
    ratios = {m: packed["tokens_per_s"] / results[m]["tokens_per_s"] for m in baselines}
    best_ratios = {m: packed["best_tokens_per_s"] / results[m]["best_tokens_per_s"] for m in baselines}
    drift = max((packed["params"][k] - results[m]["params"][k]).abs().max().item()
                for m in baselines for k in packed["params"])
    print(f"max |weight difference| packed vs padded after the same steps: {drift:.2e} "
          f"(max weight change per arm {packed['moved']:.2e})")
    for m, what in (("padded-batch", "fixed-shape rows, no remove-padding"),
                    ("padded-micro", "micro-batch padded to its own longest")):
        print(f"packed / {m} ({what}): {ratios[m]:.2f}x median, {best_ratios[m]:.2f}x best-step")
    model = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    result = {"bench": "trainer", "quick": args.quick, "sequences": len(samples), "real_tokens": sum(lengths),
              "steps": args.steps, "model": model,
              "tokens_per_s": {m: r["tokens_per_s"] for m, r in results.items()},
              "step_seconds": {m: r["step_seconds"] for m, r in results.items()},
              "ratio_vs_padded_batch": ratios["padded-batch"],
              "ratio_vs_padded_micro": ratios["padded-micro"],
              "best_step_ratio_vs_padded_batch": best_ratios["padded-batch"],
              "best_step_ratio_vs_padded_micro": best_ratios["padded-micro"],
              "max_weight_diff": drift, "attention": attention}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
