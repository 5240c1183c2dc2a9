"""Prompt jobs from an RL parquet (``retool data dapo`` / ``aime`` output or the demo's files).

Invariant: row ``k`` keeps its dataset identity (``extra_info.index`` or its row number) as the
job id, and with a sampling seed it draws seed ``seed + 7919 * k``.
"""

from __future__ import annotations

from pathlib import Path

from services.common.config import ConfigError
from services.common.schemas import ChatMessage, PromptJob, RolloutSampling
from services.data.io import iter_rows


def load_prompt_jobs(
    path: str | Path, group_size: int, sampling: RolloutSampling, max_turns: int | None
) -> list[PromptJob]:
    """Prompt jobs from an RL parquet (``retool data dapo`` / ``aime`` output).

    With ``sampling.seed`` set, row ``k`` gets seed ``seed + 7919 * k``: every prompt draws its own
    random stream (one shared seed would give sample ``i`` of every prompt the same draws).
    """
    jobs = []
    for index, row in iter_rows(path):
        messages = [ChatMessage(role=m["role"], content=m["content"]) for m in row["prompt"]]
        extra = row.get("extra_info") or {}
        jobs.append(
            PromptJob(
                job_id=str(extra.get("index") or index),
                messages=messages,
                ground_truth=str(row["reward_model"]["ground_truth"]),
                data_source=row.get("data_source"),
                n=group_size,
                sampling=sampling
                if sampling.seed is None
                else sampling.model_copy(update={"seed": sampling.seed + 7919 * index}),
                max_turns=max_turns,
            )
        )
    if not jobs:
        raise ConfigError(f"dataset {path} has no rows")
    return jobs
