"""Transformers-engine benchmark: 16 concurrent requests (batched decode) vs the same 16 one at a time.

Both runs use the same engine, model, prompts and seeded sampling parameters (temperature 1,
no stop strings, a fixed ``max_tokens``) so they generate the same number of tokens; the
baseline awaits each request before sending the next. Prints generated tokens/s for both and
the ratio (target: >= 4x on the tiny model).

Usage: ``python bench/engine.py [--quick] [--size tiny] [--concurrency 16] [--max-tokens 64]``
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def _run(model_dir: Path, concurrency: int, max_tokens: int, rounds: int) -> dict[str, float]:
    from services.rollout.engine.base import SamplingParams, collect
    from services.rollout.engine.hf import HFEngine

    engine = HFEngine(model_dir)
    tok = engine.tokenizer
    chats = [[{"role": "user", "content": f"Problem {i}: compute {i} * {i + 7}."}]
             for i in range(concurrency)]
    prompts = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for c in chats]
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i) for i in range(concurrency)]
    try:
        await collect(engine, prompts[0], params[0], "warmup")
        seq_tps, par_tps = [], []
        for r in range(rounds):
            t0 = time.perf_counter()
            n = 0
            for i in range(concurrency):
                [res] = await collect(engine, prompts[i], params[i], f"seq{r}-{i}")
                n += len(res.token_ids)
            seq_tps.append(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            results = await asyncio.gather(*(collect(engine, prompts[i], params[i], f"par{r}-{i}")
                                             for i in range(concurrency)))
            n = sum(len(res[0].token_ids) for res in results)
            par_tps.append(n / (time.perf_counter() - t0))
            print(f"  round {r + 1}: one-at-a-time {seq_tps[-1]:.0f} tok/s, "
                  f"{concurrency} concurrent {par_tps[-1]:.0f} tok/s", flush=True)
    finally:
        await engine.shutdown()
    seq, par = max(seq_tps), max(par_tps)
    return {"one_at_a_time_tok_s": round(seq, 1), "concurrent_tok_s": round(par, 1),
            "ratio": round(par / seq, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens, one round")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="best of N rounds for both")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.rounds = 32, 1

    from services.rollout.model_init import init_model_dir

    work = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    try:
        model_dir = init_model_dir(work / "model", args.size, seed=0)
        result = asyncio.run(_run(model_dir, args.concurrency, args.max_tokens, args.rounds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.update(size=args.size, concurrency=args.concurrency, max_tokens=args.max_tokens)
    print(f"\none at a time: {result['one_at_a_time_tok_s']:.0f} tok/s   {args.concurrency} concurrent: "
          f"{result['concurrent_tok_s']:.0f} tok/s   ratio {result['ratio']:.2f}x (target >= 4x)")
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
