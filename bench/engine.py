"""Engine benchmark: the transformers engine vs vLLM, same model, same prompts, same sampling, one run.

For each engine: the start time (constructor until the engine can generate, first request included),
then generated tokens/s with 1, 32 and 128 concurrent sequences (``--concurrency``). Every sequence
samples at temperature 1 with its own seed and a fixed ``max_tokens`` and no stop strings or EOS
(``eos_token_ids`` cleared), so both engines generate exactly the same number of tokens. The two
engines run one after the other in this process (not at the same time). Prints a table with the
vLLM/HF ratio per concurrency and writes it as JSON with ``--json``.

vLLM runs float32 like the HF engine (``--vllm-dtype``), eager (``enforce_eager``; ``--compile`` for
vLLM's default compiled mode).

Usage: ``python bench/engine.py [--quick] [--size small] [--max-tokens 64] [--concurrency 1 32 128]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _prompts(tok: Any, n: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": f"Problem {i}: compute {i} * {i + 7} and explain."}]
             for i in range(n)]
    return [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False) for c in chats]


async def _measure(kind: str, model_dir: Path, levels: list[int], max_tokens: int,
                   vllm_kwargs: dict[str, Any], hf_kwargs: dict[str, Any] | None = None,
                   reps: int = 2) -> dict[str, Any]:
    """Start time and tok/s per concurrency level (the best of ``reps`` passes: on an H200 the first
    pass at one sequence ran at 17 tok/s and the second at 115, warm-up alone); ``hf_kwargs`` go to
    ``HFEngine`` (device, dtype)."""
    from services.rollout.engine.base import SamplingParams, collect

    t0 = time.perf_counter()
    if kind == "hf":
        from services.rollout.engine.hf import HFEngine

        engine: Any = HFEngine(model_dir, max_batch_size=max(levels), **(hf_kwargs or {}))
    else:
        from services.rollout.engine.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, **vllm_kwargs)
    engine.eos_token_ids = set()  # every sequence runs to max_tokens on both engines
    prompts = _prompts(engine.tokenizer, max(levels))
    await collect(engine, prompts[0], SamplingParams(temperature=1.0, max_tokens=4, seed=0), "warmup")
    start_s = time.perf_counter() - t0
    out: dict[str, Any] = {"start_s": round(start_s, 1)}
    print(f"{kind}: started in {start_s:.1f} s", flush=True)
    try:
        for c in levels:
            params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i) for i in range(c)]
            for rep in range(reps):  # best of ``reps``: a first pass pays warm-up too (GPU clocks, kernels)
                t0 = time.perf_counter()
                results = await asyncio.gather(
                    *(collect(engine, prompts[i], params[i], f"{kind}-{c}-{rep}-{i}") for i in range(c)))
                seconds = time.perf_counter() - t0
                tokens = sum(len(r[0].token_ids) for r in results)
                assert tokens == c * max_tokens, (kind, c, tokens)
                out[str(c)] = max(out.get(str(c), 0.0), round(tokens / seconds, 1))
                print(f"  {kind}: {c:4d} concurrent  {tokens:6d} tokens  {seconds:7.2f} s  "
                      f"{tokens / seconds:8.1f} tok/s  (pass {rep + 1} of {reps})", flush=True)
    finally:
        await engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 tokens per sequence")
    ap.add_argument("--size", default="small",
                    help="model preset (vLLM's CPU attention needs head_dim 32, 64, ...)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--compile", action="store_true", help="vLLM without enforce_eager")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens = 32
    vllm_kwargs: dict[str, Any] = {"dtype": args.vllm_dtype, "enforce_eager": not args.compile,
                                   "max_model_len": 1024, "max_num_seqs": max(args.concurrency)}

    from services.models.tiny import init_model_dir

    work = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    try:
        model_dir = init_model_dir(work / "model", args.size, seed=0)
        hf = asyncio.run(_measure("hf", model_dir, args.concurrency, args.max_tokens, vllm_kwargs))
        vllm = asyncio.run(_measure("vllm", model_dir, args.concurrency, args.max_tokens, vllm_kwargs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [{"concurrency": c, "hf_tok_s": hf[str(c)], "vllm_tok_s": vllm[str(c)],
             "ratio_vllm_over_hf": round(vllm[str(c)] / hf[str(c)], 2)} for c in args.concurrency]
    result = {"size": args.size, "max_tokens": args.max_tokens, "vllm_kwargs": vllm_kwargs,
              "start_s": {"hf": hf["start_s"], "vllm": vllm["start_s"]}, "rows": rows}
    print(f"\nmodel preset {args.size}, {args.max_tokens} tokens per sequence, temperature 1")
    print(f"engine start (incl. first request): hf {hf['start_s']} s, vllm {vllm['start_s']} s")
    print("| concurrent | HF tok/s | vLLM tok/s | vLLM / HF |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['concurrency']} | {r['hf_tok_s']} | {r['vllm_tok_s']} | {r['ratio_vllm_over_hf']}x |")
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
