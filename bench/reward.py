"""Reward benchmark: our grader vs math-verify vs plain string matching, same cases, one run.

1. Quality on the project's hand-labelled cases (tests/data/reward_cases.jsonl): agreement
   with the labels, false accepts, false rejects, timeouts.
2. Throughput, grades/s on batches of ``--batch`` (512) answers: all cases, and the
   integer-ground-truth subset (most of DAPO-Math-17k and all of AIME). A batch cycles
   through the cases. Timed after the quality pass, which warms every system's LaTeX parser
   (antlr's prediction cache, as in a long run). Ours grades a batch with its worker
   pool (one worker per core, warm, as in service), parse caches emptied before each timed
   batch (repeats inside the batch do hit them, as a prompt's 16 samples share one ground
   truth in GRPO); math-verify runs in the main thread (its timeout relies on signals), as
   it is used in practice, and has no such cache.
3. The labelled set graded by ours as one burst (every answer at once, as a GRPO step sends
   them) and one by one, cold caches both times: the grades must be identical.
4. Math-Verify's own parametrized gold/prediction cases, as data
   (tests/data/reward_math_verify_cases.jsonl: the source commit in every row, its licence
   beside it; tests/data/make_reward_math_verify_cases.py wrote it by parsing the test files,
   never running them). Ours sees the gold as a dataset ground truth (the final answer our
   extractor finds in it, else the text without ``$``) and the prediction as a model
   response: as written when it has a ``\\boxed``, else after ``Answer:``. Math-verify is run
   twice: on the same strings with its default settings, and with each test's own settings
   (match types, precision, strictness) — its own suite. Precision, recall and F1 of each,
   timeouts apart from wrong answers. Ours is scored against the labels of its own profile
   (strict names, a set equals the relation describing it): the few rows labelled for the
   other value of a setting take their twin's label, and are listed; the suite's labels as
   written are shown too.
5. With ``--baseline REF``: ours' throughput against the grader at git REF (a temporary
   worktree), each in its own subprocess, alternating rounds, same cases and batch.

Usage: ``python bench/reward.py [--quick] [--baseline main]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The grader's code: this tree, or (``--baseline``'s subprocess) another tree's.
sys.path.insert(0, os.environ.get("BENCH_REWARD_CODE") or str(ROOT))

from services.reward.exact import to_fraction  # noqa: E402
from services.reward.extract import extract_answer  # noqa: E402
from services.reward.grader import Grader, Verdict  # noqa: E402
from services.reward.normalize import normalize, strip_math_delimiters  # noqa: E402

CASES = [
    json.loads(line)
    for line in (ROOT / "tests" / "data" / "reward_cases.jsonl").open()
]
MV_TIMEOUT_S = 5  # math-verify's own default limit, for parsing and for verifying


def string_match(response: str, truth: str) -> bool:
    """Baseline: the same extraction, then exact string comparison (no normalisation)."""
    got = extract_answer(response)
    return got is not None and got.replace(" ", "") == truth.replace(" ", "")


class MathVerify:
    """math-verify as it is used in practice; a call that reaches its limit counts as a timeout."""

    def __init__(self) -> None:
        self.timeouts = 0

    def __call__(self, response: str, truth: str, **verify_kwargs: Any) -> bool:
        from math_verify import parse, verify

        start = time.perf_counter()
        try:
            return bool(verify(parse(f"${truth}$"), parse(response), **verify_kwargs))
        except Exception:  # noqa: BLE001 - a crash is a rejection
            return False
        finally:
            if time.perf_counter() - start >= MV_TIMEOUT_S:
                self.timeouts += 1


class Ours:
    """Our grader with its warm worker pool; ``clear`` empties the workers' parse caches."""

    def __init__(self, workers: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.grader = Grader(workers=workers, timeout_s=2.0)
        self.loop.run_until_complete(self.grader.start())

    def clear(self) -> None:
        self.loop.run_until_complete(self.grader.pool.clear_caches())

    def burst(self, items: list[dict]) -> tuple[list[Verdict], float]:
        """Every item at once (one gather): the pool queues what it cannot start yet."""

        async def run() -> tuple[list[Verdict], float]:
            start = time.perf_counter()
            verdicts = await asyncio.gather(
                *(self.grader.grade(c["response"], c["ground_truth"]) for c in items)
            )
            return list(verdicts), time.perf_counter() - start

        return self.loop.run_until_complete(run())

    def one_by_one(self, items: list[dict]) -> tuple[list[Verdict], float]:
        async def run() -> tuple[list[Verdict], float]:
            start = time.perf_counter()
            verdicts = [await self.grader.grade(c["response"], c["ground_truth"]) for c in items]
            return verdicts, time.perf_counter() - start

        return self.loop.run_until_complete(run())

    def __call__(self, items: list[dict]) -> tuple[list[bool], float]:
        verdicts, elapsed = self.burst(items)
        return [v.correct for v in verdicts], elapsed

    def close(self) -> None:
        self.loop.run_until_complete(self.grader.stop())
        self.loop.close()


def sync_grades(fn, items: list[dict]) -> tuple[list[bool], float]:  # noqa: ANN001
    start = time.perf_counter()
    out = [fn(c["response"], c["ground_truth"]) for c in items]
    return out, time.perf_counter() - start


def quality(preds: list[bool], labels: list[bool]) -> dict[str, float]:
    fa = sum(p and not y for p, y in zip(preds, labels, strict=True))
    fr = sum(y and not p for p, y in zip(preds, labels, strict=True))
    return {"accuracy": 1 - (fa + fr) / len(labels), "false_accepts": fa, "false_rejects": fr}


def batch_of(items: list[dict], n: int) -> list[dict]:
    return [items[i % len(items)] for i in range(n)]


# -- Math-Verify's own test suite, as data --------------------------------------------------
MV_CASES_PATH = ROOT / "tests" / "data" / "reward_math_verify_cases.jsonl"
# The settings our grader implements, in Math-Verify's terms: strict variable names, and a set
# equals the relation that describes it (``x \\in [-2,7]`` is ``-2 \\le x \\le 7``, both ways).
OUR_PROFILE = {"strict": True, "allow_set_relation_comp": True}


def load_math_verify_cases() -> list[dict[str, Any]]:
    """Math-Verify's parametrized cases (tests/data/make_reward_math_verify_cases.py wrote them)."""
    return [json.loads(line) for line in MV_CASES_PATH.open()]


def _in_profile(settings: dict[str, Any]) -> bool:
    return all(settings.get(k, v) == v for k, v in OUR_PROFILE.items())


def profile_labels(cases: list[dict[str, Any]]) -> tuple[list[bool], list[int]]:
    """Each case's label under ``OUR_PROFILE``, and the indices that took another row's label.

    A few (gold, pred) pairs appear twice with opposite labels, one per value of a setting
    (``strict``, ``allow_set_relation_comp``); the row whose setting differs from our profile
    takes its twin's label, so ours is scored against one consistent specification.
    """
    by_pair: dict[tuple[str, str], list[int]] = {}
    for i, c in enumerate(cases):
        by_pair.setdefault((c["gold"], c["pred"]), []).append(i)
    labels, relabelled = [c["expected"] for c in cases], []
    for idx in by_pair.values():
        own = [i for i in idx if _in_profile(cases[i]["settings"] or {})]
        if own and len({cases[i]["expected"] for i in idx}) > 1:
            for i in idx:
                if i not in own and labels[i] != cases[own[0]]["expected"]:
                    labels[i] = cases[own[0]]["expected"]
                    relabelled.append(i)
    return labels, relabelled


def as_dataset_case(gold: str, pred: str) -> tuple[str, str]:
    """(response, ground truth) as the reward service gets them (see the module docstring)."""
    truth = extract_answer(gold) or strip_math_delimiters(gold)
    response = pred if "\\boxed" in pred else "Answer: " + pred
    return response, truth


def math_verify_own(case: dict[str, Any]) -> bool:
    """math-verify exactly as its test does it (the suite's ``compare_strings``)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    s = case["settings"]
    try:
        if not s:
            return bool(verify(parse(case["gold"]), parse(case["pred"])))
        kinds = {"latex": LatexExtractionConfig(boxed_match_priority=0), "expr": ExprExtractionConfig()}
        targets = [kinds[m] for m in s["match_types"]]
        return bool(
            verify(
                parse(case["gold"], targets),
                parse(case["pred"], targets),
                float_rounding=s.get("precision", 6),
                strict=s.get("strict", True),
                allow_set_relation_comp=s.get("allow_set_relation_comp", False),
            )
        )
    except Exception:  # noqa: BLE001
        return False


def labelled_row(name: str, preds: list[bool], labels: list[bool], timeouts: int) -> str:
    """One table row: right, precision, recall, F1, false accepts/rejects, timeouts apart."""
    tp = sum(p and y for p, y in zip(preds, labels, strict=True))
    fp = sum(p and not y for p, y in zip(preds, labels, strict=True))
    fn = sum(y and not p for p, y in zip(preds, labels, strict=True))
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    right = len(labels) - fp - fn
    return (f"| {name} | {right}/{len(labels)} | {precision:.4f} | {recall:.4f} | {f1:.4f} | {fp} | "
            f"{fn - timeouts} | {timeouts} |")


def run_math_verify_suite(ours: Ours, mv: MathVerify) -> None:
    cases = load_math_verify_cases()
    items = []
    for c in cases:
        response, truth = as_dataset_case(c["gold"], c["pred"])
        items.append({"response": response, "ground_truth": truth})
    labels = [c["expected"] for c in cases]
    ours_labels, relabelled = profile_labels(cases)
    verdicts = ours.burst(items)[0]
    ours_preds = [v.correct for v in verdicts]
    ours_timeouts = sum(v.reason == "timeout" and y for v, y in zip(verdicts, ours_labels, strict=True))
    before = mv.timeouts
    mv_default = [mv(i["response"], i["ground_truth"]) for i in items]
    mv_default_timeouts = mv.timeouts - before
    mv_own = [math_verify_own(c) for c in cases]
    commit = cases[0]["source"].split("@")[1].split(":")[0]
    print(f"\nMath-Verify's test suite (huggingface/Math-Verify@{commit}, {MV_CASES_PATH.name}): "
          f"{len(cases)} parametrized gold/prediction cases, {sum(not x for x in labels)} expected False\n")
    print("| grader | right | precision | recall | F1 | false accepts | false rejects (wrong) | timeouts |")
    print("|---|---|---|---|---|---|---|---|")
    print(labelled_row("ours (labels of its profile)", ours_preds, ours_labels, ours_timeouts))
    raw_timeouts = sum(v.reason == "timeout" and y for v, y in zip(verdicts, labels, strict=True))
    print(labelled_row("ours (the suite's labels as written)", ours_preds, labels, raw_timeouts))
    print(labelled_row("math-verify, its own per-case settings", mv_own, labels, 0))
    print(labelled_row("math-verify, default settings (same strings as ours)", mv_default, labels,
                       mv_default_timeouts))
    print(f"\nours' profile {OUR_PROFILE}: {len(relabelled)} rows take their twin's label: "
          + "; ".join(f"{cases[i]['gold']!r} vs {cases[i]['pred']!r} {cases[i]['settings']}"
                      for i in relabelled))
    misses = [(c, v) for c, v, y in zip(cases, verdicts, ours_labels, strict=True) if v.correct != y]
    print("ours, disagreements with its profile's labels:")
    for c, v in misses:
        print(f"  {c['source'].split('::')[1]}: gold {c['gold'][:60]!r} pred {c['pred'][-60:]!r} "
              f"label {not v.correct} ({v.reason})")


# -- throughput against a baseline tree ---------------------------------------------------------
def throughput(ours: Ours, batch: int) -> dict[str, float]:
    """Ours' grades/s on batches of all cases, integer ground truths, plain-number answers."""
    integer = [c for c in CASES if re.fullmatch(r"-?\d+", c["ground_truth"])]
    numeric = [c for c in integer if to_fraction(normalize(extract_answer(c["response"]) or "0")) is not None]
    ours(CASES)  # warm the parsers
    out = {}
    for name, items in (("all", CASES), ("integer", integer), ("numeric", numeric)):
        ours.clear()
        _, elapsed = ours(batch_of(items, batch))
        out[name] = batch / elapsed
    return out


def compare_with_baseline(ref: str, batch: int, workers: int, rounds: int) -> None:
    """Ours against the grader at git ``ref``, each in its own subprocess, alternating rounds.

    The baseline's code comes from a temporary ``git worktree`` of ``ref``; both subprocesses
    run this script (``--throughput-only``) on the same cases, one after the other, and the best
    round of each counts (the machine is shared: the best round is the least disturbed).
    """
    tree = Path(tempfile.mkdtemp(prefix="reward-baseline-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
                   check=True, capture_output=True)
    try:
        best: dict[str, dict[str, float]] = {"baseline": {}, "ours": {}}
        for _ in range(rounds):
            for name, code in (("baseline", tree), ("ours", ROOT)):
                env = {**os.environ, "BENCH_REWARD_CODE": str(code), "PYTHONPATH": str(code)}
                cmd = [sys.executable, __file__, "--throughput-only", f"--batch={batch}",
                       f"--workers={workers}"]
                out = subprocess.run(
                    cmd,
                    check=True, capture_output=True, text=True, env=env,
                )
                figures = json.loads(out.stdout.strip().splitlines()[-1])
                for k, v in figures.items():
                    best[name][k] = max(best[name].get(k, 0.0), v)
        print(f"\nthroughput, ours against {ref} (best of {rounds} alternating rounds, batch {batch}, "
              f"{workers} workers, grades/s):\n")
        print("| cases | baseline | ours | ours / baseline |")
        print("|---|---|---|---|")
        for k in best["ours"]:
            b, o = best["baseline"][k], best["ours"][k]
            print(f"| {k} | {b:.0f} | {o:.0f} | {o / b:.2f} |")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="batch of 128")
    parser.add_argument("--baseline", metavar="REF", help="also time the grader at git REF (e.g. main)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds for --baseline")
    parser.add_argument("--throughput-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.batch = 128
    if args.throughput_only:  # --baseline's subprocess: ours' figures as one JSON line
        ours = Ours(args.workers)
        print(json.dumps(throughput(ours, args.batch)))
        ours.close()
        return
    labels = [c["correct"] for c in CASES]
    integer = [c for c in CASES if re.fullmatch(r"-?\d+", c["ground_truth"])]
    # the DAPO common case: integer ground truth and a plain-number (or no) answer
    numeric = [c for c in integer if to_fraction(normalize(extract_answer(c["response"]) or "0")) is not None]
    ours = Ours(args.workers)
    mv = MathVerify()
    systems = {
        "ours": ours,
        "math-verify": lambda items: sync_grades(mv, items),
        "string-match": lambda items: sync_grades(string_match, items),
    }
    rows = {}
    for name, run in systems.items():
        timeouts_before = ours.grader.pool.timeouts if name == "ours" else mv.timeouts
        preds, _ = run(CASES)  # also warms each system's parser (antlr's DFA cache) before timing
        timeouts = (ours.grader.pool.timeouts if name == "ours" else mv.timeouts) - timeouts_before
        q = quality(preds, labels)
        if name == "ours":
            ours.clear()  # timed runs start with empty parse caches (repeats inside a batch still hit)
        _, t_all = run(batch_of(CASES, args.batch))
        if name == "ours":
            ours.clear()
        _, t_int = run(batch_of(integer, args.batch))
        _, t_num = run(batch_of(numeric, args.batch))
        rows[name] = {
            **q,
            "timeouts": timeouts if name != "string-match" else 0,
            "grades_per_s_all": args.batch / t_all,
            "grades_per_s_integer": args.batch / t_int,
            "grades_per_s_numeric": args.batch / t_num,
        }
        print(f"{name}: {rows[name]}", flush=True)
    mvr, o = rows["math-verify"], rows["ours"]
    print(
        f"\n{len(CASES)} labelled cases ({sum(not x for x in labels)} negatives); batch {args.batch}; "
        f"ours with {args.workers} workers; {os.cpu_count()} cpus\n"
    )
    print("| grader | agreement | false accepts | false rejects | timeouts "
          "| grades/s (batch, all) | grades/s (batch, integer GT) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['accuracy']:.4f} | {r['false_accepts']} | {r['false_rejects']} | "
            f"{r['timeouts']} | {r['grades_per_s_all']:.0f} | "
            f"{r['grades_per_s_integer']:.0f} |"
        )
    print(
        f"\nours / math-verify throughput: batch all {o['grades_per_s_all'] / mvr['grades_per_s_all']:.1f}x, "
        f"integer GT {o['grades_per_s_integer'] / mvr['grades_per_s_integer']:.1f}x"
    )
    print(
        f"integer GT with plain-number answers ({len(numeric)} of {len(integer)} integer-GT cases): "
        + ", ".join(f"{n} {r['grades_per_s_numeric']:.0f}/s" for n, r in rows.items())
        + f"; ours / math-verify {o['grades_per_s_numeric'] / mvr['grades_per_s_numeric']:.1f}x"
    )
    ours.clear()
    burst, t_burst = ours.burst(CASES)
    ours.clear()
    single, t_single = ours.one_by_one(CASES)
    same = [(v.correct, v.reason) for v in burst] == [(v.correct, v.reason) for v in single]
    print(
        f"\nours, the labelled set as one burst of {len(CASES)}: {t_burst:.2f} s "
        f"({len(CASES) / t_burst:.0f}/s); one by one: {t_single:.2f} s; grades identical: {same}; "
        f"timeouts over all runs: {ours.grader.pool.timeouts}"
    )
    run_math_verify_suite(ours, mv)
    ours.close()
    if args.baseline:
        compare_with_baseline(args.baseline, args.batch, args.workers, args.rounds)


if __name__ == "__main__":
    main()
