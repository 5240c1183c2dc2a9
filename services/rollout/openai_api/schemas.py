"""Pydantic v2 models of the OpenAI chat-completions request (and the retool extensions).

What is honoured and what is refused (every refusal is a 400 naming the field):
- sampling: ``temperature`` (0 = greedy), ``top_p``, ``max_completion_tokens`` / ``max_tokens``,
  ``stop`` (string or list), ``seed`` (choice ``i`` uses ``seed + i``, as ``/v1/rollouts`` does), ``n``;
- ``logprobs: true`` gives the sampled token's log-prob (``log_softmax(logits / T)``, the engine
  contract); ``top_logprobs`` > 0 is refused: the engines return only the sampled token's log-prob;
- ``tools`` (functions) with ``tool_choice`` ``auto`` / ``none``; ``required`` or a named function is
  refused (decoding is not constrained); ``frequency_penalty`` / ``presence_penalty`` other than 0,
  a non-empty ``logit_bias``, a ``response_format`` other than text, ``store: true``, audio and
  non-text content parts are refused;
- ``user``, ``metadata``, ``service_tier``, ``parallel_tool_calls`` are accepted and change nothing
  (at most one tool call per turn: generation pauses at ``</tool_call>``, as in the agent loop);
- extensions: ``return_token_ids`` (prompt ids, and per choice the token ids, log-probs and the
  policy version of every token) and, on an assistant message, ``token_ids``: the exact ids of
  that turn as returned, spliced into the prompt instead of re-rendering its text.
Unknown fields are refused, as OpenAI does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["system", "developer", "user", "assistant", "tool"]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(OpenAIModel):
    name: str
    arguments: str = Field(description="a JSON object, as a string")


class ToolCallIn(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(OpenAIModel):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # present (null) when a client echoes a response message back
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    token_ids: list[int] | None = Field(
        None,
        min_length=1,
        description="retool extension, assistant messages only: this turn's exact token ids "
        "(the choice's token_ids); they replace the rendering of the message's text",
    )

    @model_validator(mode="after")
    def _shape(self) -> ChatMessageIn:
        if self.role != "assistant":
            for name in ("tool_calls", "token_ids", "refusal"):
                if getattr(self, name) is not None:
                    raise ValueError(f"'{name}' is only allowed on assistant messages")
            if self.content is None:
                raise ValueError(f"a {self.role} message needs 'content'")
        elif self.content is None and not self.tool_calls and self.token_ids is None:
            raise ValueError("an assistant message needs 'content', 'tool_calls' or 'token_ids'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(OpenAIModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(OpenAIModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted (the official client may send it); no effect


class ChatCompletionRequest(OpenAIModel):
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; max_completion_tokens wins")
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    return_token_ids: bool = Field(False, description="retool/vLLM extension: token ids, log-probs, versions")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError(
                "top_logprobs > 0 is not supported: the engines return only the sampled token's log-prob"
            )
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError("only {'type': 'text'} is supported (decoding is not constrained)")
        return v

    @field_validator("store")
    @classmethod
    def _no_store(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("completions are not stored")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise ValueError("only ['text'] is supported")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _auto_or_none(cls, v: Any) -> Any:
        if v is not None and v not in ("auto", "none"):
            raise ValueError("only 'auto' and 'none' are supported: tool calls cannot be forced")
        return v

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in v or []]
        if len(names) != len(set(names)):
            raise ValueError("function names must be unique")
        return v

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def tools_active(self) -> bool:
        """Whether tool calls are parsed (and generation pauses at ``</tool_call>``)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def completion_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
