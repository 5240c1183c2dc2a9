"""The demo's synthetic task: multiply two numbers, where the code tool is what makes it solvable.

Invariants:
- problems are drawn with a seeded RNG; the train and held-out splits never share an (a, b) pair
  (nor its mirror (b, a)), so held-out products cannot be memorised;
- SFT traces are in the chat-message layout the SFT trainer renders inline (= the rollout agent's
  token layout): a *code* trace is ``<code>print(a*b)</code>`` → tool output (exactly the text the
  agent shows for that stdout) → ``<answer>N</answer>``; a *direct* trace is ``<answer>N</answer>``
  alone. ``code_fraction`` of the traces use the tool;
- RL and evaluation prompts are parquet files in the ``retool data dapo`` layout (``prompt``,
  ``reward_model.ground_truth``, ``extra_info.index``, ``data_source``) so the trainer and the
  evaluator read them like any other dataset.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from services.chat.tool_result import format_run_result
from services.common.config import StrictModel
from services.transport.sandbox.schemas import CommandRunResult, CommandRunStatus, RunCodeResponse, RunStatus

DATA_SOURCE = "demo_multiply"


class TaskConfig(StrictModel):
    digits_a: int = 2
    digits_b: int = 2
    sft_samples: int = 4000
    code_fraction: float = 0.5
    rl_prompts: int = 2000
    eval_prompts: int = 200
    seed: int = 0


Problem = tuple[int, int]


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def _draw(rng: random.Random, cfg: TaskConfig) -> Problem:
    lo_a, lo_b = 10 ** (cfg.digits_a - 1), 10 ** (cfg.digits_b - 1)
    return rng.randint(lo_a, 10 * lo_a - 1), rng.randint(lo_b, 10 * lo_b - 1)


def make_splits(cfg: TaskConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out): disjoint problem sets; train feeds SFT and RL, held-out only evaluation."""
    rng = random.Random(cfg.seed)
    held: list[Problem] = []
    seen: set[Problem] = set()
    while len(held) < cfg.eval_prompts:
        p = _draw(rng, cfg)
        if p not in seen:
            seen.update({p, (p[1], p[0])})
            held.append(p)
    train: list[Problem] = []
    need = cfg.sft_samples + cfg.rl_prompts
    space = 9 * 10 ** (cfg.digits_a - 1) * 9 * 10 ** (cfg.digits_b - 1)
    if need > space - len(seen):
        raise ValueError(f"sft_samples + rl_prompts = {need} exceeds the {space - len(seen)} free problems")
    while len(train) < need:
        p = _draw(rng, cfg)
        if p not in seen:
            seen.add(p)
            train.append(p)
    return train, held


def tool_output(stdout: str) -> str:
    """What the rollout agent shows the model for a successful run printing ``stdout``."""
    return format_run_result(run_answer(RunStatus.Success, stdout, "", 0), 10.0).text


def run_answer(status: RunStatus, stdout: str, stderr: str, return_code: int) -> RunCodeResponse:
    """The sandbox's answer to a run that finished with these outputs."""
    return RunCodeResponse(status=status, run_result=CommandRunResult(
        status=CommandRunStatus.Finished, stdout=stdout, stderr=stderr, return_code=return_code))


def sft_messages(a: int, b: int, use_code: bool) -> list[dict[str, str]]:
    product = a * b
    msgs = [{"role": "user", "content": question(a, b)}]
    if use_code:
        msgs += [
            {"role": "assistant", "content": f"<code>print({a}*{b})</code>"},
            {"role": "tool", "content": tool_output(f"{product}\n")},
        ]
    msgs.append({"role": "assistant", "content": f"<answer>{product}</answer>"})
    return msgs


def write_sft(path: Path, problems: list[Problem], cfg: TaskConfig) -> Path:
    """JSONL with a ``messages`` column; the code/direct choice is seeded and balanced."""
    rng = random.Random(cfg.seed + 1)
    n_code = round(len(problems) * cfg.code_fraction)
    flags = [True] * n_code + [False] * (len(problems) - n_code)
    rng.shuffle(flags)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for (a, b), use_code in zip(problems, flags, strict=True):
            fh.write(json.dumps({"messages": sft_messages(a, b, use_code)}) + "\n")
    return path


def rl_rows(problems: list[Problem], prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question(a, b)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"index": f"{prefix}-{i}"},
        }
        for i, (a, b) in enumerate(problems)
    ]


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
