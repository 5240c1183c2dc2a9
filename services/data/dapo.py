"""DAPO-Math-17k (and same-shaped RL files) → our RL training parquet.

Input rows (verl format): ``data_source``, ``prompt`` (list of chat messages), ``ability``,
``reward_model`` {``ground_truth``, ``style``}, ``extra_info`` {``index``, …}. Every row is
validated; problems are deduplicated on (normalised problem text, ground truth) — the
published file repeats ~17.9k problems ~100 times. Output rows keep the verl columns, so
the file also works with verl; ``extra_info`` gains ``problem`` and ``source_row``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError, field_validator

from services.data.io import PrepReport, iter_rows, write_rows

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'
TOOL_INSTRUCTION = (
    "\n\nYou may run Python code to help you: write it between <code> and </code>. It is executed and "
    "its output comes back between <interpreter> and </interpreter>. Use it whenever computation helps."
)


class Message(BaseModel):
    role: str
    content: str


class RewardModel(BaseModel):
    ground_truth: str
    style: str | None = None

    @field_validator("ground_truth", mode="before")
    @classmethod
    def _nonempty(cls, v: Any) -> str:
        if isinstance(v, int | float) and not isinstance(v, bool):
            v = str(v)
        if not isinstance(v, str) or not v.strip():
            raise ValueError("ground_truth must be a non-empty string")
        return v.strip()


class RLRow(BaseModel):
    data_source: str
    prompt: list[Message]
    ability: str | None = None
    reward_model: RewardModel
    extra_info: dict[str, Any] | None = None

    @field_validator("prompt")
    @classmethod
    def _has_user(cls, v: list[Message]) -> list[Message]:
        if not any(m.role == "user" and m.content.strip() for m in v):
            raise ValueError("prompt has no non-empty user message")
        return v


def problem_text(content: str) -> str:
    """The problem inside DAPO's instruction wrapper (or the whole text if there is none)."""
    text = content.strip()
    if text.startswith(DAPO_PREFIX):
        text = text[len(DAPO_PREFIX) :]
    if text.endswith(DAPO_SUFFIX):
        text = text[: -len(DAPO_SUFFIX)]
    return text.strip()


def dedupe_key(problem: str, answer: str) -> tuple[str, str]:
    return re.sub(r"\s+", " ", problem).strip().lower(), answer.strip()


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"


def prepare_dapo(
    input_path: str | Path,
    output_path: str | Path,
    *,
    tool_instruction: bool = False,
    dedupe: bool = True,
    limit: int | None = None,
) -> PrepReport:
    report = PrepReport(input=str(input_path), output=str(output_path))
    seen: set[tuple[str, str]] = set()
    out: list[dict[str, Any]] = []
    for index, raw in iter_rows(input_path):
        report.rows_read += 1
        try:
            row = RLRow.model_validate(raw)
        except ValidationError as exc:
            report.add_bad(index, _first_error(exc))
            continue
        user = next(m for m in row.prompt if m.role == "user" and m.content.strip())
        problem = problem_text(user.content)
        if not problem:
            report.add_bad(index, "prompt: empty problem text")
            continue
        key = dedupe_key(problem, row.reward_model.ground_truth)
        if dedupe and key in seen:
            report.duplicates += 1
            continue
        seen.add(key)
        prompt = [m.model_dump() for m in row.prompt]
        if tool_instruction:
            for m in prompt:
                if m["role"] == "user":
                    m["content"] = m["content"] + TOOL_INSTRUCTION
                    break
        extra = dict(row.extra_info or {})
        extra.update(problem=problem, source_row=index)
        out.append(
            {
                "data_source": row.data_source,
                "prompt": prompt,
                "ability": row.ability or "MATH",
                "reward_model": row.reward_model.model_dump(),
                "extra_info": _plain(extra),
            }
        )
        if limit is not None and len(out) >= limit:
            break
    write_rows(output_path, out)
    report.rows_written = len(out)
    return report


def _plain(extra: dict[str, Any]) -> dict[str, Any]:
    """Nested extra_info as a JSON-able dict with stable types (parquet needs one schema)."""
    return {
        "index": str(extra.get("index", "")),
        "problem": extra["problem"],
        "source_row": int(extra["source_row"]),
        "raw": json.dumps(extra, default=str, sort_keys=True),
    }
