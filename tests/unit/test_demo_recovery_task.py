"""The recovery demo's task: disjoint splits, the four behaviours at their rates, unguessable
answers (the interpreter texts against the real sandbox: tests/integration/test_demo_recovery_sandbox.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.demo.recovery_task import (
    BEHAVIOURS,
    Problem,
    Rates,
    RecoveryTaskConfig,
    bare_code,
    behaviours,
    fixed_code,
    make_splits,
    rl_rows,
    write_sft,
)


def test_splits_are_disjoint_balanced_and_seeded() -> None:
    cfg = RecoveryTaskConfig(sft_samples=900, rl_prompts=300, eval_prompts=90, seed=3)
    train, held = make_splits(cfg)
    assert len(train) == 1200 and len(held) == 90 == len(set(held))
    assert not set(train) & set(held)
    assert make_splits(cfg) == (train, held)
    assert make_splits(cfg.model_copy(update={"seed": 4})) != (train, held)
    for fn in ("comb", "gcd", "isqrt"):
        assert sum(p.fn == fn for p in held) == 30 and sum(p.fn == fn for p in train) == 400


def test_answers_are_not_guessable() -> None:
    train, held = make_splits(RecoveryTaskConfig(sft_samples=600, rl_prompts=1, eval_prompts=60))
    assert all(p.answer >= 2 for p in train + held if p.fn == "gcd")  # never the usual gcd 1
    assert all(p.answer >= 31 for p in train + held if p.fn == "isqrt")
    assert Problem(fn="comb", args=(12, 5)).answer == 792


def test_rates_are_exact_and_must_sum_to_one() -> None:
    got = behaviours(1000, Rates(error_guess=0.1, error_fix=0.2, right_first=0.3, direct=0.4), seed=0)
    assert [got.count(b) for b in BEHAVIOURS] == [100, 200, 300, 400]
    with pytest.raises(ValueError, match="sum to 1"):
        Rates(error_guess=0.5, error_fix=0.5, right_first=0.5, direct=0.0)


def test_only_fix_and_right_first_traces_answer_right(tmp_path: Path) -> None:
    cfg = RecoveryTaskConfig(sft_samples=400, rl_prompts=1, eval_prompts=30)
    problems = make_splits(cfg)[0][:400]
    rows = [json.loads(x) for x in write_sft(tmp_path / "sft.jsonl", problems, cfg).read_text().splitlines()]
    for row, p in zip(rows, problems, strict=True):
        msgs, b = row["messages"], row["behaviour"]
        calls = [m["content"] for m in msgs if m["role"] == "assistant" and m["content"].startswith("<code>")]
        expect = {"error_guess": [bare_code(p)], "error_fix": [bare_code(p), fixed_code(p)],
                  "right_first": [fixed_code(p)], "direct": []}[b]
        assert calls == [f"<code>{c}</code>" for c in expect]
        answer = msgs[-1]["content"]
        right = answer == f"<answer>{p.answer}</answer>"
        assert right == (b in ("error_fix", "right_first")), (b, answer)
        assert len(answer) == len(f"<answer>{p.answer}</answer>")  # a guess has the answer's digits
    assert {r["behaviour"] for r in rows} == set(BEHAVIOURS)


def test_rl_rows_carry_the_answer() -> None:
    row = rl_rows([Problem(fn="gcd", args=(84, 36))], "x")[0]
    assert row["reward_model"]["ground_truth"] == "12"
    assert row["prompt"] == [{"role": "user", "content": "What is gcd(84, 36)?"}]


def test_an_unknown_demo_task_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", "--task", "division", "--out", "/nonexistent/never-written"])
    assert exc.value.code == 2
    assert "--task: 'division' is not one of multiply, recovery" in capsys.readouterr().err
