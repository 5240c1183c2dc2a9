"""Wire-format benchmark: a Group as packed msgpack (ours) vs the same Group as JSON (baseline).

A group is what one rollout replica writes to Redis per prompt and what the trainer reads back:
``n`` trajectories of ``L`` tokens with ids, loss mask, log-probs and versions. Measures bytes,
encode and decode time (decode includes pydantic validation of the alignment invariants), and
prints ours/baseline ratios.

Usage: ``python bench/rollout_codec.py [--quick] [--n 16] [--tokens 8192] [--repeat 5]``
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.schemas import Group, Trajectory  # noqa: E402


def make_group(n: int, tokens: int, seed: int = 0) -> Group:
    rng = random.Random(seed)
    trajs = []
    for i in range(n):
        ids, mask, lps, vers = [], [], [], []
        for k in range(tokens):
            tool = (k // 512) % 4 == 3  # a quarter of the tokens come from the interpreter
            ids.append(rng.randrange(152_000))
            mask.append(0 if tool else 1)
            lps.append(0.0 if tool else -rng.random() * 3)
            vers.append(-1 if tool else 12)
        trajs.append(
            Trajectory(
                index=i,
                response_ids=ids,
                loss_mask=mask,
                logprobs=lps,
                versions=vers,
                turns=4,
                tool_calls=3,
                finish_reason="eos",
                reward=1.0,
                correct=True,
                extracted="34",
            )
        )
    return Group(job_id="bench", prompt_ids=list(range(300)), trajectories=trajs, ground_truth="34")


def best_of(fn, repeat: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.quick:
        args.n, args.tokens, args.repeat = 4, 2048, 3
    group = make_group(args.n, args.tokens)
    ours = group.to_msgpack()
    base = group.model_dump_json()
    enc_ours = best_of(group.to_msgpack, args.repeat)
    enc_base = best_of(group.model_dump_json, args.repeat)
    dec_ours = best_of(lambda: Group.from_msgpack(ours), args.repeat)
    dec_base = best_of(lambda: Group.model_validate_json(base), args.repeat)
    print(f"group: n={args.n} x {args.tokens} tokens ({args.n * args.tokens} tokens)")
    print(f"{'':10}{'msgpack (ours)':>16}{'JSON (baseline)':>18}{'ours/baseline':>15}")
    print(f"{'bytes':10}{len(ours):>16,}{len(base):>18,}{len(ours) / len(base):>15.3f}")
    print(f"{'encode s':10}{enc_ours:>16.4f}{enc_base:>18.4f}{enc_ours / enc_base:>15.3f}")
    print(f"{'decode s':10}{dec_ours:>16.4f}{dec_base:>18.4f}{dec_ours / dec_base:>15.3f}")


if __name__ == "__main__":
    main()
