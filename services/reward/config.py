"""Reward service configuration (env prefix ``RETOOL_REWARD``)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

from services.common.config import StrictModel
from services.common.security import ServerSecurity


class ShapingConfig(StrictModel):
    """Optional reward shaping; off by default and reported apart from correctness."""

    tool_bonus: bool = Field(
        False, description="verl ReTool: wrong answers get min(-0.6, -1 + 0.1*tool_calls)"
    )
    format_penalty: float = Field(0.0, le=0.0, description="added when no final answer can be extracted")


class RewardConfig(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(8090, ge=0, le=65535)
    log_level: str = "INFO"
    correct_score: float = 1.0
    incorrect_score: float = -1.0
    timeout_s: float = Field(
        2.0,
        gt=0,
        le=60,
        description="work limit of one symbolic check: CPU seconds of its worker, counted from "
        "when a worker starts on it (never the wait for a worker); a wall-clock backstop of 10x "
        "stops a worker that cannot run at all",
    )
    workers: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1), ge=1, le=256)
    max_queue: int = Field(
        4096,
        ge=1,
        description="symbolic checks admitted and unfinished; a request that would exceed it gets "
        "503 + Retry-After and nothing of it is graded (an idle pool admits any batch)",
    )
    max_batch: int = Field(4096, ge=1)
    max_response_chars: int = Field(1_000_000, ge=1, description="longer responses: 422 naming the field")
    max_ground_truth_chars: int = Field(
        10_000, ge=1, description="longer ground truths: 422 naming the field"
    )
    max_answer_chars: int = Field(
        1000, ge=1, description="longer extracted answers (unless the truth is long too) are cut off: "
        "incorrect, reason timeout"
    )
    timeout_policy: Literal["incorrect", "drop"] = Field(
        "incorrect",
        description="a grade that timed out: 'incorrect' scores it incorrect_score (reason timeout); "
        "'drop' answers train=false and score=null: the response trains with no reward, and the "
        "trainer drops its whole group (ledger reason reward_timeout) so no advantage is biased. "
        "The default: timeouts were 0 on 836 labelled cases (bench/reward.py), and a drop throws "
        "away a whole group",
    )
    shaping: ShapingConfig = ShapingConfig()
    security: ServerSecurity = Field(
        default_factory=ServerSecurity,
        description="bearer token (and optional TLS) every route but /healthz and /metrics requires")
