"""AIME 2024/2025 rows → validation parquet (same columns as the RL training file).

Accepts the public files' column spellings (``Problem``/``Answer`` in AIME_2024,
``problem``/``answer`` in aime_2025). AIME answers are integers 0–999; a row whose
answer is not is reported and skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.data.dapo import DAPO_PREFIX, DAPO_SUFFIX, TOOL_INSTRUCTION
from services.data.io import PrepReport, columns_of, iter_rows, write_rows


def _pick(row: dict[str, Any], *names: str) -> Any:
    lowered = {k.lower(): v for k, v in row.items()}
    for n in names:
        if lowered.get(n) is not None:
            return lowered[n]
    return None


def prepare_aime(
    input_path: str | Path,
    output_path: str | Path,
    *,
    data_source: str | None = None,
    tool_instruction: bool = False,
) -> PrepReport:
    cols = {c.lower() for c in columns_of(input_path)}
    if not ({"problem", "question"} & cols and "answer" in cols):
        raise ValueError(
            f"{input_path}: expected 'problem' (or 'Problem') and 'answer' columns; found {sorted(cols)}"
        )
    source = data_source or Path(input_path).stem.lower()
    report = PrepReport(input=str(input_path), output=str(output_path))
    out: list[dict[str, Any]] = []
    for index, row in iter_rows(input_path):
        report.rows_read += 1
        problem, answer = _pick(row, "problem", "question"), _pick(row, "answer")
        if not isinstance(problem, str) or not problem.strip():
            report.add_bad(index, "problem: missing or empty")
            continue
        text = str(answer).strip() if answer is not None else ""
        if not (text.isdigit() and int(text) <= 999):
            report.add_bad(index, f"answer: {answer!r} is not an integer in 0..999")
            continue
        content = f"{DAPO_PREFIX}\n\n{problem.strip()}\n\n{DAPO_SUFFIX}"
        if tool_instruction:
            content += TOOL_INSTRUCTION
        out.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": content}],
                "ability": "MATH",
                "reward_model": {"ground_truth": str(int(text)), "style": "rule"},
                "extra_info": {
                    "index": str(_pick(row, "id") or index),
                    "problem": problem.strip(),
                    "source_row": index,
                    "raw": "",
                },
            }
        )
    write_rows(output_path, out)
    report.rows_written = len(out)
    return report
