"""Pydantic v2 models of what ``/v1/chat/completions`` and ``/v1/models`` return (OpenAI shapes).

Invariant: the OpenAI fields are always present (``null`` where OpenAI allows it); the retool
extensions (``prompt_token_ids``; per choice ``token_ids``, ``token_logprobs``, ``token_versions``;
``policy_version`` of a model) are present only when asked for, so a plain OpenAI client sees
plain OpenAI objects. ``token_logprobs[i]`` and ``token_versions[i]`` belong to ``token_ids[i]``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer


class _Out(BaseModel):
    """Output model whose ``_optional`` fields are left out when they are ``None``."""

    _optional: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_unset_extensions(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in self._optional:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class FunctionCallOut(_Out):
    name: str
    arguments: str


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(_Out):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TokenLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(_Out):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(_Out):
    _optional = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class TokenArrays(_Out):
    """The retool extension of a choice: one entry per generated token."""

    _optional = frozenset({"token_ids", "token_logprobs", "token_versions"})
    token_ids: list[int] | None = None
    token_logprobs: list[float] | None = None
    token_versions: list[int] | None = None


class Choice(TokenArrays):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Out):
    _optional = frozenset({"prompt_token_ids"})
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class Delta(_Out):
    _optional = frozenset({"role", "content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class StreamChoice(TokenArrays):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(_Out):
    _optional = frozenset({"prompt_token_ids", "usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[StreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "retool"
    root: str | None = None
    max_model_len: int | None = None
    policy_version: int = Field(description="version of the weights being served")


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorBody
