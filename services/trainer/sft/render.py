"""Chat messages (user, then assistant / tool turns) -> token ids + loss mask for SFT.

Invariants (``input_ids`` and ``loss_mask`` always have the same length; mask 1 only on tokens
the model itself must produce):
- ``inline`` (default) is the rollout agent loop's layout for one response
  (services/rollout/agent/loop.py): prompt = the messages before the first assistant turn,
  chat-templated with ``add_generation_prompt=True`` by ``services.chat.format.build_prompt`` (mask 0);
  then every assistant turn's text tokenized on its own (mask 1; hermes tool calls written as the
  ``<tool_call>{json}</tool_call>`` text the model generates), every tool turn as the agent's
  ``result_template`` around ``truncate_middle(output, max_tool_output_chars)`` tokenized on its
  own (mask 0), and finally the EOS token (mask 1) when ``append_eos``.
- ``chat_template``: each message rendered by the tokenizer's chat template, incrementally; the
  text added by message k is ``render(messages[:k+1])[len(render(messages[:k])):]`` (the template
  must be prefix-stable, else an error); for an assistant message the generation prompt is mask 0
  and its body mask 1 up to and including its last EOS token.
- The first token is always a prompt token (mask 0), as packing requires.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from services.chat.format import (  # noqa: F401 - tool_result_text re-exported (tests/unit/test_sft_render.py)
    ChatFormat,
    build_prompt,
    hermes_tool_schema,
    tool_result_ids,
    tool_result_text,
)

Render = Literal["inline", "chat_template"]


class RenderError(ValueError):
    """A sample whose messages cannot be rendered (reported with the row index)."""


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def _content(msg: dict[str, Any]) -> str:
    content = msg.get("content")
    return "" if content is None else str(content)


def _split_prompt(messages: list[dict[str, Any]]) -> int:
    """Index of the first assistant message; it must exist and be preceded by a user message."""
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            if i == 0:
                raise RenderError("the first message is an assistant message: there is no prompt")
            return i
    raise RenderError("no assistant message")


def hermes_call_text(call: dict[str, Any]) -> str:
    """A hermes tool call as the text the model generates (Qwen2.5 layout)."""
    fn = call.get("function") or call
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise RenderError(f"tool call arguments are not JSON: {exc}") from None
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def assistant_text(msg: dict[str, Any]) -> str:
    text = _content(msg)
    for call in msg.get("tool_calls") or []:
        text = f"{text}\n{hermes_call_text(call)}" if text else hermes_call_text(call)
    return text


def render_inline(messages: list[dict[str, Any]], tokenizer: Any, agent: ChatFormat, *,
                  append_eos: bool = True) -> Rendered:
    first = _split_prompt(messages)
    ids = build_prompt(tokenizer, messages[:first], agent)
    mask = [0] * len(ids)
    last_role = None
    for m in messages[first:]:
        role = m.get("role")
        if role == "assistant":
            piece = list(tokenizer.encode(assistant_text(m), add_special_tokens=False))
            ids += piece
            mask += [1] * len(piece)
        elif role == "tool":
            if last_role != "assistant":
                raise RenderError("a tool message must follow an assistant message")
            piece = tool_result_ids(tokenizer, _content(m), agent)
            ids += piece
            mask += [0] * len(piece)
        else:
            raise RenderError(f"inline rendering supports one response: unexpected {role!r} message after "
                              "the first assistant turn (use data.render=chat_template)")
        last_role = role
    if last_role != "assistant":
        raise RenderError("the conversation must end with an assistant message")
    if append_eos:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise RenderError("the tokenizer has no eos_token_id (set data.append_eos=false)")
        ids.append(int(eos))
        mask.append(1)
    return Rendered(ids, mask)


def _for_template(msg: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as objects, as chat templates expect (OpenAI messages carry them as JSON
    strings; Qwen2.5's template writes ``arguments | tojson``, which would quote a string again and
    teach the model a call layout the rollout never writes)."""
    calls = msg.get("tool_calls")
    if not calls:
        return msg
    out = []
    for call in calls:
        fn = dict(call.get("function") or call)
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError as exc:
                raise RenderError(f"tool call arguments are not JSON: {exc}") from None
        out.append({**call, "function": fn} if "function" in call else fn)
    return {**msg, "tool_calls": out}


def render_chat_template(messages: list[dict[str, Any]], tokenizer: Any, agent: ChatFormat) -> Rendered:
    _split_prompt(messages)
    kwargs: dict[str, Any] = {"tokenize": False}
    if agent.tool_format == "hermes":
        kwargs["tools"] = [hermes_tool_schema(agent.tool_name)]
    clean = [_for_template({k: v for k, v in m.items() if v is not None}) for m in messages]

    def text(k: int, gen: bool) -> str:
        return str(tokenizer.apply_chat_template(clean[:k], add_generation_prompt=gen, **kwargs)) if k else ""

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[int] = []
    prev = ""
    for k, m in enumerate(clean):
        if m.get("role") == "assistant":
            head = text(k, True)
            if not head.startswith(prev):
                raise RenderError(f"chat template is not prefix-stable at message {k}")
            piece = list(tokenizer.encode(head[len(prev):], add_special_tokens=False))
            ids += piece
            mask += [0] * len(piece)
            prev = head
        cur = text(k + 1, False)
        if not cur.startswith(prev):
            raise RenderError(f"chat template is not prefix-stable at message {k}")
        piece = list(tokenizer.encode(cur[len(prev):], add_special_tokens=False))
        if m.get("role") == "assistant":
            last = max((j for j, t in enumerate(piece) if t == eos), default=len(piece) - 1)
            mask += [1] * (last + 1) + [0] * (len(piece) - last - 1)
        else:
            mask += [0] * len(piece)
        ids += piece
        prev = cur
    if not ids or mask[0] != 0:
        raise RenderError("the rendered sample must start with a prompt token")
    return Rendered(ids, mask)


def render(messages: list[dict[str, Any]], tokenizer: Any, agent: ChatFormat, mode: Render = "inline", *,
           append_eos: bool = True) -> Rendered:
    if mode == "inline":
        out = render_inline(messages, tokenizer, agent, append_eos=append_eos)
    else:
        out = render_chat_template(messages, tokenizer, agent)
    if len(out.input_ids) != len(out.loss_mask):
        raise AssertionError("rendered ids and mask differ in length")
    if not any(out.loss_mask):
        raise RenderError("no assistant tokens to train on")
    if out.loss_mask[0] != 0:
        raise RenderError("the rendered sample must start with a prompt token")
    return out
