"""HTTP models of the reward service."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ScoreRequest(BaseModel):
    response: str
    ground_truth: str = Field(..., min_length=1)
    data_source: str | None = None
    num_tool_calls: int = Field(0, ge=0)


class ScoreResult(BaseModel):
    score: float | None = Field(description="null only when train is false")
    correct: bool
    extracted: str | None
    reason: str
    shaping: float = Field(0.0, description="part of score that comes from shaping, not correctness")
    train: bool = Field(
        True, description="false: the grade timed out under timeout_policy=drop; train with no reward")


class BatchRequest(BaseModel):
    items: list[ScoreRequest]


class BatchResponse(BaseModel):
    results: list[ScoreResult]
