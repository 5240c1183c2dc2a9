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
4. With ``--math-verify-tests DIR`` (a checkout of huggingface/Math-Verify's ``tests``;
   nothing of it is stored here): agreement on its parametrized gold/prediction cases. The
   cases are read from the test files' ``pytest.mark.parametrize`` decorators. Ours sees the
   gold as a dataset ground truth (the final answer our extractor finds in it, else the text
   without ``$``) and the prediction as a model response: as written when it has a
   ``\\boxed``, else after ``Answer:``. Math-verify is run twice: on the same strings with
   its default settings, and with each test's own settings (match types, precision,
   strictness) — its own suite.

Usage: ``python bench/reward.py [--quick] [--math-verify-tests PATH/TO/Math-Verify/tests]``
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.reward.exact import to_fraction  # noqa: E402
from services.reward.extract import extract_answer  # noqa: E402
from services.reward.grader import Grader, Verdict  # noqa: E402
from services.reward.normalize import normalize, strip_math_delimiters  # noqa: E402

CASES = [
    json.loads(line)
    for line in (Path(__file__).resolve().parents[1] / "tests" / "data" / "reward_cases.jsonl").open()
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


# -- Math-Verify's own test suite ------------------------------------------------------------
def _literal(node: ast.expr) -> Any:  # noqa: ANN401 - any literal of a test file
    try:
        return ast.literal_eval(node)
    except ValueError:  # e.g. f"{math.sqrt(17):.15f}": a tiny expression of the math module
        return eval(compile(ast.Expression(node), "<case>", "eval"), {"math": math})  # noqa: S307


def _settings(fn: ast.FunctionDef, row: dict[str, Any]) -> dict[str, Any]:
    """The math-verify settings a test passes to ``compare_strings`` (its helper), if any."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "compare_strings":
            out: dict[str, Any] = {"match_types": ["latex", "expr"]}
            for kw in node.keywords:
                out[kw.arg or ""] = row[kw.value.id] if isinstance(kw.value, ast.Name) else _literal(kw.value)
            return out
    return {}  # parse() and verify() with their defaults


def math_verify_suite(tests_dir: Path) -> list[dict[str, Any]]:
    """Every parametrized (gold, pred, expected) case of math-verify's tests, with its settings."""
    cases = []
    for path in sorted(tests_dir.glob("test_*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for dec in fn.decorator_list:
                if not (isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize"):
                    continue
                names = [n.strip() for n in _literal(dec.args[0]).split(",")]
                if "gold" not in names or "pred" not in names:
                    continue
                for elt in dec.args[1].elts:  # type: ignore[attr-defined]
                    row = dict(zip(names, _literal(elt), strict=True))
                    expected = bool(row.get("expected", row.get("result")))
                    cases.append({"test": f"{path.stem}::{fn.name}", "gold": row["gold"], "pred": row["pred"],
                                  "expected": expected, "settings": _settings(fn, row)})
    return cases


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


def run_math_verify_suite(tests_dir: Path, ours: Ours, mv: MathVerify) -> None:
    cases = math_verify_suite(tests_dir)
    items = []
    for c in cases:
        response, truth = as_dataset_case(c["gold"], c["pred"])
        items.append({"response": response, "ground_truth": truth})
    labels = [c["expected"] for c in cases]
    ours_preds = [v.correct for v in ours.burst(items)[0]]
    rows = {
        "ours": ours_preds,
        "math-verify (same strings, default settings)": [mv(i["response"], i["ground_truth"]) for i in items],
        "math-verify (its own test settings)": [math_verify_own(c) for c in cases],
    }
    print(f"\nMath-Verify's test suite ({tests_dir}): {len(cases)} parametrized gold/prediction cases, "
          f"{sum(not x for x in labels)} expected False\n")
    print("| grader | agreement | false accepts | false rejects |")
    print("|---|---|---|---|")
    for name, preds in rows.items():
        q = quality(preds, labels)
        agree = round(q["accuracy"] * len(labels))
        fa, fr = q["false_accepts"], q["false_rejects"]
        print(f"| {name} | {agree}/{len(labels)} ({q['accuracy']:.3f}) | {fa} | {fr} |")
    misses = Counter(
        c["test"].split("::")[1] for c, p in zip(cases, ours_preds, strict=True) if p != c["expected"]
    )
    print("\nours, disagreements by test: " + ", ".join(f"{k} {v}" for k, v in misses.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="batch of 128")
    parser.add_argument("--math-verify-tests", type=Path, help="a checkout of Math-Verify's tests/ directory")
    args = parser.parse_args()
    if args.quick:
        args.batch = 128
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
    if args.math_verify_tests:
        run_math_verify_suite(args.math_verify_tests, ours, mv)
    ours.close()


if __name__ == "__main__":
    main()
