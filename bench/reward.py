"""Reward benchmark: our grader vs math-verify vs plain string matching, same cases, one run.

Accuracy, false accepts and false rejects on the hand-labelled cases
(tests/data/reward_cases.jsonl), and grades/s on batches of 512: all cases, and the
integer-ground-truth subset (most of DAPO-Math-17k and all of AIME). A batch of 512 cycles
through the cases, so a case appears 2-4 times in it. Ours grades a batch with its worker
pool (one worker per core, warm, as in service); their parse caches are emptied before
each timed batch (repeats inside the batch do hit them, as a prompt's 16 samples share one
ground truth in GRPO); math-verify runs in the main thread (its timeout relies on signals),
as it is used in practice, and has no such cache.

Usage: ``python bench/reward.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.reward.exact import to_fraction  # noqa: E402
from services.reward.extract import extract_answer  # noqa: E402
from services.reward.grader import Grader  # noqa: E402
from services.reward.normalize import normalize  # noqa: E402

CASES = [
    json.loads(line)
    for line in (Path(__file__).resolve().parents[1] / "tests" / "data" / "reward_cases.jsonl").open()
]


def string_match(response: str, truth: str) -> bool:
    """Baseline: the same extraction, then exact string comparison (no normalisation)."""
    got = extract_answer(response)
    return got is not None and got.replace(" ", "") == truth.replace(" ", "")


def math_verify_grade(response: str, truth: str) -> bool:
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${truth}$"), parse(response)))
    except Exception:  # noqa: BLE001 - a crash is a rejection
        return False


class Ours:
    """Our grader with its warm worker pool; ``clear`` empties the workers' parse caches."""

    def __init__(self, workers: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.grader = Grader(workers=workers, timeout_s=2.0)
        self.loop.run_until_complete(self.grader.start())

    def clear(self) -> None:
        self.loop.run_until_complete(self.grader.pool.clear_caches())

    def __call__(self, items: list[dict]) -> tuple[list[bool], float]:
        async def run() -> tuple[list[bool], float]:
            start = time.perf_counter()
            verdicts = await asyncio.gather(
                *(self.grader.grade(c["response"], c["ground_truth"]) for c in items)
            )
            return [v.correct for v in verdicts], time.perf_counter() - start

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.loop.run_until_complete(self.grader.stop())
        self.loop.close()


def sync_grades(fn, items: list[dict]) -> tuple[list[bool], float]:  # noqa: ANN001
    start = time.perf_counter()
    out = [fn(c["response"], c["ground_truth"]) for c in items]
    return out, time.perf_counter() - start


def quality(preds: list[bool]) -> dict[str, float]:
    labels = [c["correct"] for c in CASES]
    fa = sum(p and not y for p, y in zip(preds, labels, strict=True))
    fr = sum(y and not p for p, y in zip(preds, labels, strict=True))
    return {"accuracy": 1 - (fa + fr) / len(labels), "false_accepts": fa, "false_rejects": fr}


def batch_of(items: list[dict], n: int) -> list[dict]:
    return [items[i % len(items)] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="batch of 128")
    args = parser.parse_args()
    if args.quick:
        args.batch = 128
    integer = [c for c in CASES if re.fullmatch(r"-?\d+", c["ground_truth"])]
    # the DAPO common case: integer ground truth and a plain-number (or no) answer
    numeric = [c for c in integer if to_fraction(normalize(extract_answer(c["response"]) or "0")) is not None]
    ours = Ours(args.workers)
    systems = {
        "ours": ours,
        "math-verify": lambda items: sync_grades(math_verify_grade, items),
        "string-match": lambda items: sync_grades(string_match, items),
    }
    rows = {}
    for name, run in systems.items():
        preds, _ = run(CASES)
        q = quality(preds)
        if name == "ours":
            ours.clear()  # timed runs start with empty parse caches (repeats inside a batch still hit)
        _, t_all = run(batch_of(CASES, args.batch))
        if name == "ours":
            ours.clear()
        _, t_int = run(batch_of(integer, args.batch))
        _, t_num = run(batch_of(numeric, args.batch))
        rows[name] = {
            **q,
            "grades_per_s_all": args.batch / t_all,
            "grades_per_s_integer": args.batch / t_int,
            "grades_per_s_numeric": args.batch / t_num,
        }
        print(f"{name}: {rows[name]}", flush=True)
    timeouts = ours.grader.pool.timeouts
    ours.close()
    mv = rows["math-verify"]
    print(
        f"\n{len(CASES)} labelled cases ({sum(not c['correct'] for c in CASES)} negatives); "
        f"batch {args.batch}; ours with {args.workers} workers; {os.cpu_count()} cpus\n"
    )
    print("| grader | accuracy | false accepts | false rejects | grades/s (all) | grades/s (integer GT) |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['accuracy']:.4f} | {r['false_accepts']} | {r['false_rejects']} | "
            f"{r['grades_per_s_all']:.0f} | {r['grades_per_s_integer']:.0f} |"
        )
    o = rows["ours"]
    print(
        f"\nours / math-verify throughput: all {o['grades_per_s_all'] / mv['grades_per_s_all']:.1f}x, "
        f"integer GT {o['grades_per_s_integer'] / mv['grades_per_s_integer']:.1f}x"
    )
    print(
        f"integer GT with plain-number answers ({len(numeric)} of {len(integer)} integer-GT cases): "
        + ", ".join(f"{n} {r['grades_per_s_numeric']:.0f}/s" for n, r in rows.items())
        + f"; ours / math-verify {o['grades_per_s_numeric'] / mv['grades_per_s_numeric']:.1f}x"
    )
    print(f"ours: {timeouts} grades hit the 2 s limit over all runs (each one counts as incorrect)")


if __name__ == "__main__":
    main()
