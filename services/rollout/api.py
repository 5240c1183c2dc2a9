"""HTTP request model of ``POST /v1/rollouts`` and the server-sent-event encoding of its stream.

Stream events (``event: <type>`` then ``data: <json>``): ``token`` {index, token_ids, text},
``tool_call`` {index, code, error}, ``tool_result`` {index, text, error}, ``done`` {index,
trajectory}, and finally ``end`` {job_id, n, weight_version} or ``error`` {detail}.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, model_validator

from services.common.schemas import ChatMessage, RolloutSampling, WireModel


class RolloutRequest(WireModel):
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    prompt_ids: list[int] | None = Field(None, min_length=1, description="already chat-templated")
    ground_truth: str | None = Field(None, description="when given, every response is scored")
    data_source: str | None = None
    n: int = Field(1, ge=1)
    sampling: RolloutSampling = Field(default_factory=RolloutSampling)
    max_turns: int | None = Field(None, ge=0)
    stream: bool = False
    request_id: str | None = Field(None, max_length=200)

    @model_validator(mode="after")
    def _one_prompt(self) -> RolloutRequest:
        if (self.messages is None) == (self.prompt_ids is None):
            raise ValueError("exactly one of 'messages' or 'prompt_ids' must be given")
        return self


def sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
