"""Wire-format benchmark: a Group as schema 2 (``group_wire``, ours) vs schema 1 (the format before).

A group is what one rollout replica writes to Redis per prompt and what the trainer reads back:
``n`` trajectories of ``L`` tokens with ids, loss mask, log-probs and versions. Both codecs run on
the same group in the same process; the table gives bytes per token, encode microseconds per token
(from the list-based ``Group`` the rollout side builds), and decode + validation throughput in
tokens/s as the trainer's feed does it: schema 1 into a ``Group`` of lists (the feed before),
schema 2 into a ``PackedGroup`` of numpy views (the feed now). "to tensors" adds what the trainer
does next, ``build_samples`` (ids, mask and log-probs as tensors, GRPO advantages) on the decoded
group: from lists (old) or from the numpy views (new). The last row decodes schema 2 into lists
(``Group.from_msgpack``, for callers that want lists). Ratios are new/old.

``--profile`` adds the top cProfile entries of each encode and decode (hot spots).
``--compression`` adds schema 2 bytes through zstd (level 3) and lz4: size, and decode throughput
with the decompression included (the option schema 2 does not take: see docs/benchmarks.md).

Usage: ``python bench/rollout_codec.py [--quick] [--n 16] [--tokens 16384] [--repeat 5] [--profile]
[--compression]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.group_wire import decode_group, encode_group  # noqa: E402
from services.common.group_wire_v1 import decode_v1, encode_v1  # noqa: E402
from services.common.schemas import Group, Trajectory  # noqa: E402
from services.trainer.batch import Rollout, build_samples  # noqa: E402

VOCAB = 152_000  # Qwen2.5's vocabulary: ids need 3 bytes


def make_group(n: int, tokens: int, seed: int = 0) -> Group:
    """ReTool-shaped: every fourth 512-token block is interpreter output (mask 0, version -1), and
    odd samples see a weight swap halfway (version 12 -> 13)."""
    rng = random.Random(seed)
    trajs = []
    for i in range(n):
        ids, mask, lps, vers = [], [], [], []
        for k in range(tokens):
            tool = (k // 512) % 4 == 3
            ids.append(rng.randrange(VOCAB))
            mask.append(0 if tool else 1)
            lps.append(0.0 if tool else -rng.random() * 3)
            vers.append(-1 if tool else 12 + (i % 2 and k >= tokens // 2))
        trajs.append(Trajectory(index=i, response_ids=ids, loss_mask=mask, logprobs=lps, versions=vers,
                                turns=4, tool_calls=3, tool_call_errors=[False, True, False],
                                finish_reason="eos", reward=1.0, correct=True, extracted="34"))
    return Group(job_id="bench", prompt_ids=[rng.randrange(VOCAB) for _ in range(300)], trajectories=trajs,
                 ground_truth="34", min_version=12, max_version=13 if n > 1 else 12)


def to_tensors(group: Any) -> None:
    """What the trainer does with a decoded group (``loop.rollouts_of`` + ``build_samples``)."""
    build_samples([Rollout(group_id=group.job_id, prompt_ids=group.prompt_ids,
                           response_ids=t.response_ids, response_loss_mask=t.loss_mask,
                           reward=t.reward or 0.0, rollout_logprobs=t.logprobs)
                   for t in group.trajectories])


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def hot_spots(fn: Callable[[], Any], top: int = 8) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "tottime" in line)
    return "\n".join(line for line in lines[start:] if line.strip())


def compressed(raw: bytes, tokens: int, repeat: int) -> None:
    import lz4.frame
    import zstandard

    zstd = zstandard.ZstdDecompressor()
    for name, packed, unpack in (
        ("zstd-3", zstandard.ZstdCompressor(level=3).compress(raw), zstd.decompress),
        ("lz4", lz4.frame.compress(raw), lz4.frame.decompress),
    ):
        seconds = best_of(lambda p=packed, u=unpack: decode_group(u(p)), repeat)
        print(f"new + {name:7} {len(packed) / tokens:.2f} bytes/token, "
              f"decompress+decode+validate {tokens / seconds / 1e6:.1f} M tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compression", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.n, args.tokens, args.repeat = 4, 2048, 3
    group = make_group(args.n, args.tokens)
    tokens = args.n * args.tokens
    old, new = encode_v1(group), encode_group(group)
    assert decode_group(new).to_group() == decode_v1(old)  # same content both ways
    codecs = {
        "old": (lambda: encode_v1(group), lambda: decode_v1(old)),
        "new": (lambda: encode_group(group), lambda: decode_group(new)),
    }
    enc = {k: best_of(e, args.repeat) for k, (e, _) in codecs.items()}
    dec = {k: best_of(d, args.repeat) for k, (_, d) in codecs.items()}
    feed = {"old": best_of(lambda: to_tensors(decode_v1(old)), args.repeat),
            "new": best_of(lambda: to_tensors(decode_group(new)), args.repeat)}
    to_lists = best_of(lambda: Group.from_msgpack(new), args.repeat)

    print(f"group: n={args.n} x {args.tokens} tokens = {tokens:,} tokens, vocabulary {VOCAB:,}")
    print(f"{'':34}{'old (schema 1)':>16}{'new (schema 2)':>16}{'new/old':>10}")
    rows = [
        ("bytes/token", len(old) / tokens, len(new) / tokens, "{:.2f}"),
        ("encode us/token", enc["old"] / tokens * 1e6, enc["new"] / tokens * 1e6, "{:.3f}"),
        ("decode+validate M tokens/s", tokens / dec["old"] / 1e6, tokens / dec["new"] / 1e6, "{:.1f}"),
        ("decode+validate+to tensors M tok/s", tokens / feed["old"] / 1e6, tokens / feed["new"] / 1e6,
         "{:.1f}"),
    ]
    for name, a, b, fmt in rows:
        print(f"{name:34}{fmt.format(a):>16}{fmt.format(b):>16}{b / a:>10.3f}")
    print(f"{'new, decoded to lists M tokens/s':34}{'':>16}{tokens / to_lists / 1e6:>16.1f}"
          f"{dec['old'] / to_lists:>10.3f}")
    print(f"bytes: old {len(old):,}, new {len(new):,}")
    if args.compression:
        compressed(new, tokens, args.repeat)
    if args.profile:
        for name, (e, d) in codecs.items():
            print(f"\n== {name} encode ==\n{hot_spots(e)}\n== {name} decode+validate ==\n{hot_spots(d)}")


if __name__ == "__main__":
    main()
