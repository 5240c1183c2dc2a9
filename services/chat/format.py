"""The chat layout of one tool-using response, shared by the rollout agent loop and SFT.

Invariants:
- the prompt is the messages chat-templated once as text (``add_generation_prompt=True``, the
  hermes tool schema passed as ``tools`` in hermes format), then encoded without extra special
  tokens: ``build_prompt`` is the only place this happens;
- a tool result is ``template`` with ``{output}`` replaced by the output cut in the middle to
  ``max_tool_output_chars`` (``truncate_middle``), lone surrogates replaced by U+FFFD (a tokenizer
  cannot encode them): ``tool_result_text`` is the only place; ``tool_result_ids`` its token ids,
  the only place they are made: special-token text printed by the code (``<|im_end|>``,
  ``<|im_start|>system``) is encoded as plain text, never as the special token, so hostile output
  cannot forge a turn end or a chat header; special tokens the template itself writes stay special;
- ``ChatFormat`` holds only what changes tokens; the rollout's ``AgentConfig`` extends it with how
  the loop runs (turns, budgets, retries), so SFT and rollout cannot disagree on the layout.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from services.common.config import StrictModel

ToolFormat = Literal["code", "hermes"]

CODE_RESULT_TEMPLATE = "\n<interpreter>\n{output}\n</interpreter>\n"
HERMES_RESULT_TEMPLATE = "\n<tool_response>\n{output}\n</tool_response>\n"


class ChatTokenizer(Protocol):
    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class ChatFormat(StrictModel):
    """What decides the tokens of a tool-using response: the tool-call syntax and result layout."""

    tool_format: ToolFormat = Field("code", description="code: <code>..</code>; hermes: <tool_call>{json}")
    tool_name: str = Field("code_interpreter", min_length=1, description="hermes function name")
    max_tool_output_chars: int = Field(2048, ge=16, description="longer outputs keep head and tail")
    result_template: str | None = Field(
        None,
        description="text appended after a tool call; {output} is replaced. Default per format: "
        f"code {CODE_RESULT_TEMPLATE!r}, hermes {HERMES_RESULT_TEMPLATE!r}",
    )

    @model_validator(mode="after")
    def _template(self) -> ChatFormat:
        if self.result_template is not None and "{output}" not in self.result_template:
            raise ValueError("result_template must contain '{output}'")
        return self

    @property
    def tool_stop(self) -> str:
        return "</code>" if self.tool_format == "code" else "</tool_call>"

    @property
    def template(self) -> str:
        if self.result_template is not None:
            return self.result_template
        return CODE_RESULT_TEMPLATE if self.tool_format == "code" else HERMES_RESULT_TEMPLATE


def hermes_tool_schema(name: str) -> dict[str, Any]:
    """The code tool as an OpenAI/hermes function schema."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "Run Python code and return its stdout and stderr.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source to execute"}},
                "required": ["code"],
            },
        },
    }


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the tail of ``text`` so the result has at most ``max_chars`` characters."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[{len(text)} chars, middle truncated]...\n"
    keep = max(max_chars - len(marker), 2)
    head = keep // 2
    tail = keep - head
    return text[:head] + marker + text[len(text) - tail :]


def _shown_output(output: str, fmt: ChatFormat) -> str:
    cut = truncate_middle(output, fmt.max_tool_output_chars)
    return cut.encode("utf-8", "surrogatepass").decode("utf-8", "replace")  # lone surrogates -> U+FFFD


def tool_result_text(output: str, fmt: ChatFormat) -> str:
    """Exactly the text appended after a tool call with this output."""
    return fmt.template.replace("{output}", _shown_output(output, fmt))


def tool_result_ids(tokenizer: Any, output: str, fmt: ChatFormat) -> list[int]:
    """The token ids appended after a tool call (decoding them gives ``tool_result_text``).

    One encode of the whole text, special tokens split, when the template holds no special token
    (the defaults); otherwise the template's pieces keep their special tokens and only the output
    is split.
    """
    specials = [t for t in getattr(tokenizer, "all_special_tokens", ()) if t and t in fmt.template]
    if not specials:
        return list(tokenizer.encode(tool_result_text(output, fmt), add_special_tokens=False,
                                     split_special_tokens=True))
    shown = list(tokenizer.encode(_shown_output(output, fmt), add_special_tokens=False,
                                  split_special_tokens=True))
    ids: list[int] = []
    for k, piece in enumerate(fmt.template.split("{output}")):
        ids += shown if k else []
        ids += list(tokenizer.encode(piece, add_special_tokens=False)) if piece else []
    return ids


def build_prompt(tokenizer: ChatTokenizer, messages: list[dict[str, Any]], fmt: ChatFormat) -> list[int]:
    """The prompt token ids of ``messages`` (see the module invariants)."""
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if fmt.tool_format == "hermes":
        kwargs["tools"] = [hermes_tool_schema(fmt.tool_name)]
    text = tokenizer.apply_chat_template(messages, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
