"""Section 4, engine: the transformers engine generating on the device (bf16 on CUDA) at 1 / 32 /
128 concurrent sequences, with ``bench/engine.py``'s measurement (every sequence samples exactly
``engine_max_tokens`` tokens: EOS and stop strings off).
"""

from __future__ import annotations

import asyncio

from bench.gpu.common import Ctx


def run(ctx: Ctx) -> None:
    from bench.engine import _measure
    from services.models.tiny import init_model_dir

    sizes = ctx.sizes
    model_dir = init_model_dir(ctx.work / "engine-model", sizes.engine_preset, seed=0)  # type: ignore[arg-type]
    hf = {"device": ctx.device, "dtype": sizes.compute_dtype}
    ctx.save(preset=sizes.engine_preset, dtype=sizes.compute_dtype, max_tokens=sizes.engine_max_tokens)
    # CUDA: best of two passes per level (a first pass measured warm-up: 17 against 115 tok/s on an H200)
    reps = 2 if ctx.device == "cuda" else 1
    res = asyncio.run(_measure("hf", model_dir, list(sizes.engine_levels), sizes.engine_max_tokens, {}, hf,
                               reps=reps))
    ctx.save(
        start_s=res["start_s"], rows=[{"concurrency": c, "tok_s": res[str(c)]} for c in sizes.engine_levels]
    )
