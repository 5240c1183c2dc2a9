"""The demo task: disjoint splits, balanced traces, and traces that render to exactly the token
layout the rollout agent produces for the same conversation."""

from __future__ import annotations

import json

import pytest

from services.demo.task import TaskConfig, make_splits, rl_rows, sft_messages, tool_output, write_sft
from services.rollout.config import AgentConfig
from services.trainer.sft.render import render_inline


def test_splits_are_disjoint_and_seeded() -> None:
    cfg = TaskConfig(sft_samples=300, rl_prompts=100, eval_prompts=50, seed=3)
    train, held = make_splits(cfg)
    assert len(train) == 400 and len(held) == 50
    assert make_splits(cfg) == (train, held)
    assert make_splits(cfg.model_copy(update={"seed": 4})) != (train, held)
    held_keys = {p for a, b in held for p in ((a, b), (b, a))}
    assert not held_keys & set(train)
    assert all(10 <= x <= 99 for p in train + held for x in p)


def test_too_many_problems_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        make_splits(TaskConfig(digits_a=1, digits_b=1, sft_samples=80, rl_prompts=10, eval_prompts=5))


def test_traces_are_balanced(tmp_path) -> None:
    cfg = TaskConfig(code_fraction=0.25)
    problems = make_splits(cfg.model_copy(update={"sft_samples": 200, "rl_prompts": 0}))[0]
    path = write_sft(tmp_path / "sft.jsonl", problems, cfg)
    rows = [json.loads(x)["messages"] for x in path.read_text().splitlines()]
    assert sum(any(m["role"] == "tool" for m in r) for r in rows) == 50
    for r, (a, b) in zip(rows, problems, strict=True):
        assert r[-1] == {"role": "assistant", "content": f"<answer>{a * b}</answer>"}


def test_code_trace_renders_as_the_agent_layout() -> None:
    from services.models.tiny import build_tokenizer

    tok = build_tokenizer(512, individual_digits=True)
    agent = AgentConfig()
    r = render_inline(sft_messages(37, 48, use_code=True), tok, agent)
    text = tok.decode(r.input_ids)
    assert text.endswith("<code>print(37*48)</code>\n<interpreter>\n1776\n</interpreter>\n"
                         "<answer>1776</answer><|im_end|>")
    masked = tok.decode([t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if m == 0])
    assert masked.endswith("\n<interpreter>\n1776\n</interpreter>\n")  # interpreter tokens carry no loss
    assert tool_output("1776\n") == "1776"
    assert [tok.decode([t]) for t in tok.encode("1776", add_special_tokens=False)] == ["1", "7", "7", "6"]


def test_rl_rows_carry_the_product() -> None:
    row = rl_rows([(12, 34)], "x")[0]
    assert row["reward_model"]["ground_truth"] == "408"
    assert row["prompt"] == [{"role": "user", "content": "What is 12 * 34?"}]
    assert row["extra_info"]["index"] == "x-0"


def test_trainer_gives_every_prompt_its_own_sampling_stream(tmp_path) -> None:
    from services.common.schemas import RolloutSampling
    from services.data.prompt_jobs import load_prompt_jobs
    from services.demo.task import write_parquet

    path = write_parquet(tmp_path / "rl.parquet", rl_rows([(11, 12), (13, 14), (15, 16)], "t"))
    jobs = load_prompt_jobs(path, 4, RolloutSampling(seed=5), 1)
    assert [j.sampling.seed for j in jobs] == [5, 5 + 7919, 5 + 2 * 7919]
    assert {j.job_id for j in jobs} == {"t-0", "t-1", "t-2"} and all(j.n == 4 for j in jobs)
    assert all(j.sampling.seed is None for j in load_prompt_jobs(path, 4, RolloutSampling(), 1))
