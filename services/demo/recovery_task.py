"""The recovery demo's task: ``What is comb(12, 5)?`` (or ``gcd``, ``isqrt``), where the function is
not in scope of the bare interpreter, so a first call ``print(comb(12, 5))`` raises a ``NameError``
naming it and a second call that imports it (``from math import comb``) succeeds.

Invariants:
- problems are drawn with seeded RNGs from a finite pool per function; the held-out problems are
  taken out of the pool first, and the training problems (SFT and RL) are drawn only from the rest,
  so train and held-out never share a problem (training problems may repeat among themselves);
- the answer cannot be guessed: ``gcd`` problems are ``gcd(g*x, g*y)`` with ``g >= 2`` and
  ``x, y`` coprime (never 1, the usual gcd of random numbers), ``isqrt`` and ``comb`` answers have
  several digits;
- SFT traces take four behaviours at the fixed ``rates`` (exact counts, seeded order):
  ``error_guess`` (the bare call raises, then a guessed answer), ``error_fix`` (the bare call
  raises, the fixed call prints the value, the answer copies it), ``right_first`` (the fixed call
  first) and ``direct`` (a guessed answer, no call). A guess is a number with as many digits as
  the answer and never equal to it, so only ``error_fix`` and ``right_first`` can be right;
- each interpreter text in a trace is exactly what the rollout agent shows for the sandbox's
  answer to that code (``interpreter_text``: a Python 3.11 ``NameError`` traceback of ``main.py``,
  checked against the real sandbox in the tests), in the chat-message layout of ``task.py``.
"""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from services.chat.tool_result import format_run_result
from services.common.config import StrictModel
from services.demo.task import run_answer, tool_output
from services.transport.sandbox.schemas import RunStatus

DATA_SOURCE = "demo_recovery"
FUNCTIONS = ("comb", "gcd", "isqrt")
Behaviour = Literal["error_guess", "error_fix", "right_first", "direct"]
BEHAVIOURS: tuple[Behaviour, ...] = ("error_guess", "error_fix", "right_first", "direct")


class Rates(StrictModel):
    """Fraction of SFT traces per behaviour; they sum to 1."""

    error_guess: float = Field(0.35, ge=0, le=1)
    error_fix: float = Field(0.25, ge=0, le=1)
    right_first: float = Field(0.1, ge=0, le=1)
    direct: float = Field(0.3, ge=0, le=1)

    @model_validator(mode="after")
    def _sum(self) -> Rates:
        total = sum(getattr(self, b) for b in BEHAVIOURS)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"rates must sum to 1, got {total:g}")
        return self


class RecoveryTaskConfig(StrictModel):
    sft_samples: int = Field(4000, ge=1)
    rates: Rates = Field(default_factory=Rates)
    rl_prompts: int = Field(2000, ge=1)
    eval_prompts: int = Field(200, ge=3, le=600, description="held-out problems (a third per function)")
    seed: int = 0


class Problem(StrictModel, frozen=True):
    fn: str
    args: tuple[int, ...]

    @property
    def call(self) -> str:
        return f"{self.fn}({', '.join(str(a) for a in self.args)})"

    @property
    def answer(self) -> int:
        return int(getattr(math, self.fn)(*self.args))


@functools.cache
def _pool(fn: str) -> tuple[Problem, ...]:
    """Every problem of one function, in a fixed order."""
    return tuple(_enumerate(fn))


def _enumerate(fn: str) -> list[Problem]:
    if fn == "comb":
        return [Problem(fn=fn, args=(n, k)) for n in range(10, 31) for k in range(2, 7)]
    if fn == "gcd":
        return [Problem(fn=fn, args=(g * x, g * y)) for g in range(2, 40) for x in range(2, 30)
                for y in range(2, 30) if x != y and math.gcd(x, y) == 1]
    if fn == "isqrt":
        return [Problem(fn=fn, args=(n,)) for n in range(1000, 100000, 7)]
    raise ValueError(f"fn: {fn!r} is not one of {FUNCTIONS}")


def question(p: Problem) -> str:
    return f"What is {p.call}?"


def make_splits(cfg: RecoveryTaskConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out): ``sft_samples + rl_prompts`` training problems drawn from the pool left
    after the held-out ones were taken out; functions in equal shares, order seeded."""
    rng = random.Random(cfg.seed)
    held: list[Problem] = []
    rest: dict[str, list[Problem]] = {}
    for i, fn in enumerate(FUNCTIONS):
        pool = _pool(fn)
        take = cfg.eval_prompts // len(FUNCTIONS) + (i < cfg.eval_prompts % len(FUNCTIONS))
        chosen = set(rng.sample(range(len(pool)), take))
        held += [pool[j] for j in sorted(chosen)]
        rest[fn] = [p for j, p in enumerate(pool) if j not in chosen]
    rng.shuffle(held)
    train = [rng.choice(rest[FUNCTIONS[i % len(FUNCTIONS)]]) for i in range(cfg.sft_samples + cfg.rl_prompts)]
    rng.shuffle(train)
    return train, held


def bare_code(p: Problem) -> str:
    return f"print({p.call})"


def fixed_code(p: Problem) -> str:
    return f"from math import {p.fn}\nprint({p.call})"


def name_error(p: Problem) -> str:
    """The sandbox's stderr for ``bare_code(p)`` (Python 3.11, the code run as ``main.py``; the
    sandbox's caret line sits one column right of plain ``python main.py``'s)."""
    line = bare_code(p)
    return (f'Traceback (most recent call last):\n  File "main.py", line 1, in <module>\n    {line}\n'
            f"{' ' * (5 + len('print('))}{'^' * len(p.fn)}\nNameError: name '{p.fn}' is not defined\n")


def interpreter_text(p: Problem, fixed: bool) -> str:
    """What the rollout agent shows the model for one of the two calls."""
    if fixed:
        return tool_output(f"{p.answer}\n")
    return format_run_result(run_answer(RunStatus.Failed, "", name_error(p), 1), 10.0).text


def guess(p: Problem, rng: random.Random) -> int:
    """A number with as many digits as the answer, never the answer."""
    digits = len(str(p.answer))
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    while (g := rng.randint(lo, hi)) == p.answer:
        pass
    return g


def sft_messages(p: Problem, behaviour: Behaviour, rng: random.Random) -> list[dict[str, str]]:
    msgs = [{"role": "user", "content": question(p)}]
    if behaviour in ("error_guess", "error_fix"):
        msgs += [{"role": "assistant", "content": f"<code>{bare_code(p)}</code>"},
                 {"role": "tool", "content": interpreter_text(p, fixed=False)}]
    if behaviour in ("error_fix", "right_first"):
        msgs += [{"role": "assistant", "content": f"<code>{fixed_code(p)}</code>"},
                 {"role": "tool", "content": interpreter_text(p, fixed=True)}]
    right = behaviour in ("error_fix", "right_first")
    msgs.append({"role": "assistant", "content": f"<answer>{p.answer if right else guess(p, rng)}</answer>"})
    return msgs


def behaviours(n: int, rates: Rates, seed: int) -> list[Behaviour]:
    """Exactly ``round(n * rate)`` traces per behaviour (the last one takes the rounding rest)."""
    counts = [round(n * getattr(rates, b)) for b in BEHAVIOURS[:-1]]
    counts.append(n - sum(counts))
    if counts[-1] < 0:
        raise ValueError(f"rates do not fit {n} samples")
    out: list[Behaviour] = [b for b, c in zip(BEHAVIOURS, counts, strict=True) for _ in range(c)]
    random.Random(seed).shuffle(out)
    return out


def write_sft(path: Path, problems: list[Problem], cfg: RecoveryTaskConfig) -> Path:
    """JSONL with a ``messages`` column; behaviours at ``cfg.rates``, guesses seeded."""
    rng = random.Random(cfg.seed + 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for p, b in zip(problems, behaviours(len(problems), cfg.rates, cfg.seed + 1), strict=True):
            fh.write(json.dumps({"messages": sft_messages(p, b, rng), "behaviour": b}) + "\n")
    return path


def rl_rows(problems: list[Problem], prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question(p)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"index": f"{prefix}-{i}"},
        }
        for i, p in enumerate(problems)
    ]


def tokenizer_corpus(seed: int = 0, lines: int = 600) -> list[str]:
    """Texts of this task for the tokenizer's training, so tracebacks and imports get merges."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        fn = FUNCTIONS[i % len(FUNCTIONS)]
        p = rng.choice(_pool(fn)[:50])
        out += [question(p), f"<code>{bare_code(p)}</code>", name_error(p), f"<code>{fixed_code(p)}</code>"]
    return out
