"""Extract the code of a tool call from one model turn (``<code>`` or hermes ``<tool_call>`` format).

Invariant: parsing never raises on model output; a malformed call yields a ``ToolCall`` with
``error`` set, whose text goes back to the model inside the interpreter block.

Formats:
- code: ``... <code>CODE</code>``; CODE may be a fenced block (```` ```python ... ``` ````), whose
  inside is used;
- hermes: ``<tool_call>{"name": "code_interpreter", "arguments": {"code": "..."}}</tool_call>``;
  ``arguments`` may also be a JSON string holding that object. ``parse_hermes_function`` decodes a
  call to any function (name + arguments object): the OpenAI API's ``tool_calls`` use it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class ToolCall:
    code: str | None = None
    error: str | None = None


def strip_fence(text: str) -> str:
    m = _FENCE.search(text)
    return (m.group(1) if m else text).strip()


def _region(text: str, open_tag: str, close_tag: str) -> str | None:
    end = text.find(close_tag)
    if end < 0:
        return None
    start = text.rfind(open_tag, 0, end)
    if start < 0:
        return None
    return text[start + len(open_tag) : end]


def parse_code_call(turn_text: str) -> ToolCall:
    body = _region(turn_text, "<code>", "</code>")
    if body is None:
        if "</code>" not in turn_text:
            return ToolCall(error="Tool call error: no </code> closing tag")
        # no opening tag: accept a fenced block right before </code>
        head = turn_text[: turn_text.find("</code>")]
        if _FENCE.search(head) is None:
            return ToolCall(error="Tool call error: </code> without an opening <code> tag")
        body = head
    code = strip_fence(body)
    if not code:
        return ToolCall(error="Tool call error: the code block is empty")
    return ToolCall(code=code)


@dataclass(frozen=True)
class FunctionCall:
    """A hermes call decoded to ``name`` and an ``arguments`` object (or ``error``, never both)."""

    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None


def parse_hermes_function(turn_text: str) -> FunctionCall:
    """The last ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of a turn, any function.

    ``arguments`` may also be a JSON string holding the object (OpenAI style); ``parameters`` is
    accepted as a synonym. Errors use the wording models are trained on ("Failed to decode tool
    call: ...").
    """
    body = _region(turn_text, "<tool_call>", "</tool_call>")
    if body is None:
        return FunctionCall(error="Failed to decode tool call: missing <tool_call> opening tag")
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return FunctionCall(error=f"Failed to decode tool call: {exc}")
    if not isinstance(obj, dict):
        return FunctionCall(
            error="Failed to decode tool call: expected a JSON object with 'name' and 'arguments'"
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return FunctionCall(error=f"Unknown tool {name!r}: 'name' must be a non-empty string")
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            return FunctionCall(name=name, error=f"Failed to decode tool call arguments: {exc}")
    if not isinstance(args, dict):
        return FunctionCall(name=name, error="Tool call error: 'arguments' must be a JSON object")
    return FunctionCall(name=name, arguments=args)


def parse_hermes_call(turn_text: str, tool_name: str = "code_interpreter") -> ToolCall:
    call = parse_hermes_function(turn_text)
    if call.name is not None and call.name != tool_name:
        return ToolCall(error=f"Unknown tool {call.name!r}; the only tool is {tool_name!r}")
    if call.error is not None:
        if "'arguments' must be" in call.error:
            return ToolCall(error="Tool call error: 'arguments' must be an object with a 'code' string")
        return ToolCall(error=call.error)
    assert call.arguments is not None
    code = call.arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        return ToolCall(error="Tool call error: 'arguments.code' must be a non-empty string")
    return ToolCall(code=strip_fence(code) if "```" in code else code)
