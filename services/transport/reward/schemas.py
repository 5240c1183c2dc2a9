"""HTTP models of the reward service."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ScoreRequest(BaseModel):
    response: str
    ground_truth: str = Field(..., min_length=1)
    data_source: str | None = None
    num_tool_calls: int = Field(0, ge=0)


class ScoreResult(BaseModel):
    score: float
    correct: bool
    extracted: str | None
    reason: str
    shaping: float = Field(0.0, description="part of score that comes from shaping, not correctness")


class BatchRequest(BaseModel):
    items: list[ScoreRequest]


class BatchResponse(BaseModel):
    results: list[ScoreResult]
