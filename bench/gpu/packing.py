"""Section 3, packing: packed varlen vs padded micro-batches on the same batch, and the attention
backends on their own.

1. model level (``packing_preset`` in ``compute_dtype`` on the device, forward + backward of every
   micro-batch of one batch, arms interleaved, best of ``reps``): packed with the default varlen
   backend (the fused kernel on CUDA), packed with our per-sequence loop, and padded (4 sequences
   per micro-batch in arrival order, padded to the micro-batch's longest, the model's sdpa with a
   2-D mask). tokens/s counts real tokens only; the packed arms' log-probs are compared.
2. attention only: ``bench/varlen_attention.py`` at the 0.5B model's head layout (14 / 2 heads × 64).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.gpu.common import Ctx, build_lm, rl_lengths, sync, train_samples


def run(ctx: Ctx) -> None:
    import torch

    from bench.varlen_attention import measure
    from services.trainer import varlen_attention as va
    from services.trainer.actor import Actor
    from services.trainer.packing import pack, pad, plan_micro_batches

    sizes, dev = ctx.sizes, ctx.device
    dtype = getattr(torch, sizes.compute_dtype)
    lm = build_lm(sizes.packing_preset, dev, seed=0).to(dtype)
    lengths = rl_lengths(sizes.packing_tokens, sizes.length_scale, seed=5)
    samples = train_samples(lengths, lm.config.vocab_size, seed=5)
    budget = max(sizes.micro_batch_tokens, max(lengths))
    packed = [
        pack([samples[i] for i in micro]).to(torch.device(dev))
        for micro in plan_micro_batches(lengths, budget)
    ]
    padded = [pad(samples[i : i + 4]).to(torch.device(dev)) for i in range(0, len(samples), 4)]
    default = va.available_backends(dev, dtype)[0]
    arms: dict[str, tuple[Actor, list[Any]]] = {
        f"packed ({default})": (Actor(lm, varlen_backend=default), packed)
    }
    if default != "loop":
        arms["packed (loop)"] = (Actor(lm, varlen_backend="loop"), packed)
    arms["padded (sdpa, 2-D mask)"] = (Actor(lm, varlen_packed=False), padded)
    ctx.save(
        preset=sizes.packing_preset,
        dtype=sizes.compute_dtype,
        sequences=len(lengths),
        real_tokens=sum(lengths),
        packed_micro_batches=len(packed),
        padded_micro_batches=len(padded),
        padded_computed_tokens=sum(mb.computed_tokens for mb in padded),
        default_backend=default,
    )

    def once(actor: Actor, mbs: list[Any]) -> tuple[float, list[torch.Tensor]]:
        sync(dev)
        t0 = time.perf_counter()
        outs = []
        for mb in mbs:
            lp, _ = actor(mb.input_ids, mb.position_ids, mb.attention_mask)
            lp.sum().backward()
            outs.append(lp.detach().float())
        sync(dev)
        actor.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, outs

    failed: dict[str, str] = {}
    for n in list(arms):
        try:
            once(*arms[n])  # warm-up
        except Exception as exc:  # e.g. a fused kernel this card or build lacks: recorded, the rest run
            failed[n] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            del arms[n]
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[torch.Tensor]] = {}
    for rep in range(sizes.reps):
        if rep and ctx.left() < 30:
            break
        for j in range(len(names)):
            n = names[(rep + j) % len(names)]
            seconds, outputs[n] = once(*arms[n])
            times[n].append(seconds)
    model = {
        n: {
            "best_seconds": min(t),
            "median_seconds": statistics.median(t),
            "tokens_per_s": sum(lengths) / min(t),
        }
        for n, t in times.items()
    }
    base = model.get("padded (sdpa, 2-D mask)", {}).get("tokens_per_s")
    for row in model.values():
        if base:
            row["vs_padded"] = row["tokens_per_s"] / base
    if "packed (loop)" in outputs and names[0] != "packed (loop)":
        diff = max(
            float((a - b).abs().max())
            for a, b in zip(outputs[names[0]], outputs["packed (loop)"], strict=True)
        )
        model[names[0]]["max_logprob_diff_vs_loop"] = diff
    packed_arms = [n for n in model if n.startswith("packed")]
    ctx.save(
        model=model,
        model_errors=failed,
        fastest_packed=max(packed_arms, key=lambda n: model[n]["tokens_per_s"]) if packed_arms else None,
    )
    del arms, lm
    if dev == "cuda":
        torch.cuda.empty_cache()
    attention = measure(
        sizes.attention_tokens,
        14,
        2,
        64,
        dev,
        dtype,
        reps=sizes.reps,
        deadline=time.monotonic() + max(5.0, ctx.left() - 10),
        scale=sizes.length_scale,
    )
    ctx.save(attention=attention)
    if failed:
        raise RuntimeError(f"packing arms failed: {failed}")
