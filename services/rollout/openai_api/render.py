"""Chat messages -> prompt token ids, splicing in the exact ids of earlier assistant turns.

Rendering: the conversation goes through the tokenizer's chat template once, as text, with
``add_generation_prompt=True`` (and ``tools`` when given); an assistant message that carries
``token_ids`` is rendered as a unique marker instead of its text. The text between markers is
encoded on its own (no special tokens added) and each marker is replaced by its message's ids:

    ids = encode(text before marker 1) + token_ids(1) + encode(text between 1 and 2) + ... + encode(tail)

When a turn's ids end with a special token (EOS, e.g. ``<|im_end|>``) that the template also writes
right after the message, the template's copy is dropped, so the end of turn appears once.

Invariants:
- the ids of a spliced assistant turn appear in the prompt exactly as given, never re-tokenized;
- without ``token_ids`` the prompt equals the agent loop's ``build_prompt`` (same template call,
  same encoding), so turn 1 of a conversation is the agent loop's prompt;
- with the same ``tools`` and earlier messages, turn ``k + 1``'s prompt starts with turn ``k``'s
  prompt followed by turn ``k``'s ids (for templates that render a prefix of a conversation as a
  prefix of its text, which chat templates do); the messages after the spliced turn are rendered
  by the template, so a ``tool`` message appears as the template writes tool results
  (``chat_tool_result_template`` gives that text for the agent loop's ``result_template``).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from services.rollout.agent.loop import Tokenizer
from services.rollout.openai_api.schemas import ChatMessageIn


@dataclass
class RenderError(ValueError):
    """A request that cannot be rendered; ``param`` names the field (OpenAI's error ``param``)."""

    param: str
    message: str

    def __str__(self) -> str:
        return f"{self.param}: {self.message}"


class ChatRenderer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)  # type: ignore[arg-type]
        self.special_ids = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()))

    def render(self, messages: list[ChatMessageIn], tools: list[dict[str, Any]] | None = None) -> list[int]:
        nonce = secrets.token_hex(6)
        convo: list[dict[str, Any]] = []
        splices: list[tuple[str, list[int], int]] = []
        for i, msg in enumerate(messages):
            if msg.token_ids is not None:
                self._check_ids(msg.token_ids, f"messages[{i}].token_ids")
                marker = f"\u2063retool-splice:{nonce}:{i}\u2063"
                splices.append((marker, list(msg.token_ids), i))
                convo.append({"role": "assistant", "content": marker})
            else:
                convo.append(_template_message(msg, i))
        text = self._template(convo, tools)
        ids: list[int] = []
        pos = 0
        for marker, turn_ids, i in splices:
            at = text.find(marker, pos)
            if at < 0:
                raise RenderError(
                    f"messages[{i}].token_ids",
                    "the chat template does not write this assistant message's content verbatim, so "
                    "its token ids cannot be spliced in",
                )
            ids += self._encode(text[pos:at])
            ids += turn_ids
            pos = at + len(marker)
            end = self._end_of_turn_text(turn_ids)
            if end and text.startswith(end, pos):
                pos += len(end)
        ids += self._encode(text[pos:])
        return ids

    def _template(self, convo: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        try:
            return str(self.tokenizer.apply_chat_template(convo, **kwargs))
        except Exception as exc:  # jinja raises several unrelated types (e.g. roles must alternate)
            raise RenderError("messages", f"the chat template rejected the conversation: {exc}") from None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _end_of_turn_text(self, turn_ids: list[int]) -> str:
        last = turn_ids[-1]
        if last not in self.special_ids:
            return ""
        return self.tokenizer.decode([last], skip_special_tokens=False)

    def _check_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            raise RenderError(param, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")


def _template_message(msg: ChatMessageIn, index: int) -> dict[str, Any]:
    """An OpenAI message as chat templates expect it (tool-call arguments as objects)."""
    role = "system" if msg.role == "developer" else msg.role
    out: dict[str, Any] = {"role": role, "content": msg.text()}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:
        calls = []
        for j, call in enumerate(msg.tool_calls):
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                raise RenderError(
                    f"messages[{index}].tool_calls[{j}].function.arguments", f"not valid JSON: {exc}"
                ) from None
            fn = {"name": call.function.name, "arguments": args}
            calls.append({"id": call.id, "type": "function", "function": fn})
        out["tool_calls"] = calls
    return out


def chat_tool_result_template(tokenizer: Tokenizer, tools: list[dict[str, Any]] | None = None) -> str:
    """What the chat template writes after an assistant turn that ends in a tool call, around a tool
    result, up to the next generation prompt -- with ``{output}`` where the result goes.

    Used as the agent loop's ``result_template``, it makes ``/v1/rollouts`` lay out a tool turn
    exactly as ``/v1/chat/completions`` does with ``role: tool`` messages.
    """
    marker = "\u2063retool-turn\u2063"
    convo = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": marker},
        {"role": "tool", "content": "{output}"},
    ]
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    text = str(tokenizer.apply_chat_template(convo, **kwargs))
    return text[text.index(marker) + len(marker) :]
