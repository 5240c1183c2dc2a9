"""Small parquet files shaped exactly like the public ones (column names, nesting, types)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from services.data.dapo import DAPO_PREFIX, DAPO_SUFFIX

DAPO_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("index", pa.string()),
                    ("need_tools_kwargs", pa.bool_()),
                    (
                        "tools_kwargs",
                        pa.struct(
                            [
                                (
                                    "code_interpreter",
                                    pa.struct(
                                        [("create_kwargs", pa.struct([("ground_truth", pa.string())]))]
                                    ),
                                )
                            ]
                        ),
                    ),
                ]
            ),
        ),
    ]
)


def dapo_row(problem: str, answer: str, *, user: bool = True) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [
            {"content": f"{DAPO_PREFIX}\n\n{problem}\n\n{DAPO_SUFFIX}", "role": "user" if user else "system"}
        ],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {
            "index": str(uuid.uuid4()),
            "need_tools_kwargs": True,
            "tools_kwargs": {"code_interpreter": {"create_kwargs": {"ground_truth": answer}}},
        },
    }


def write_dapo(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_SCHEMA), path)
    return path


RETOOL_SFT_SCHEMA = pa.schema(
    [
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ]
)

RETOOL_USER_TEMPLATE = (
    "Solve the following problem step by step. You now have the ability to selectively write executable "
    "Python code to enhance your reasoning process. The Python code will be executed by an external sandbox, "
    "and the output (wrapped in `<interpreter>output_str</interpreter>`) can be returned to aid your "
    "reasoning and help you arrive at the final answer.\n\n*user question:*\n{question}\n\nRemember to place "
    "the final answer in the last part using the format: \n<answer>\n\\boxed{{'The final answer goes here.'}}"
    "\n</answer>"
)


def retool_sft_row(question: str, trace: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": RETOOL_USER_TEMPLATE.format(question=question)},
            {"role": "assistant", "content": trace},
        ]
    }


def write_retool_sft(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=RETOOL_SFT_SCHEMA), path)
    return path


def write_aime_2024(path: Path, rows: list[tuple[str, str, int]]) -> Path:
    """Maxwell-Jia/AIME_2024 layout: ID, Problem, Solution, Answer (int64)."""
    table = pa.table(
        {
            "ID": [r[0] for r in rows],
            "Problem": [r[1] for r in rows],
            "Solution": ["..." for _ in rows],
            "Answer": pa.array([r[2] for r in rows], pa.int64()),
        }
    )
    pq.write_table(table, path)
    return path


def write_aime_2025(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    """yentinglin/aime_2025 layout: id, problem, answer (string), url, year."""
    table = pa.table(
        {
            "id": [r[0] for r in rows],
            "problem": [r[1] for r in rows],
            "answer": [r[2] for r in rows],
            "url": ["https://example.invalid" for _ in rows],
            "year": ["2025" for _ in rows],
        }
    )
    pq.write_table(table, path)
    return path
