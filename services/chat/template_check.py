"""Is a chat template append-only in our multi-turn rendering? (in the manner of verl's
``scripts/chat_template_checker.py``)

Invariant checked: for a probe conversation of ``turns`` tool rounds (user; then assistant tool
call, tool result, ... ; final assistant answer), rendering the first ``k + 1`` messages starts
with the rendering of the first ``k``, and the generation prompt (``add_generation_prompt``)
before each assistant message is a prefix of the rendering that includes it. That is what lets a
trajectory's tokens be appended turn by turn and what ``render_chat_template`` (SFT) relies on;
a template that rewrites earlier turns (drops past reasoning, moves a marker onto the last turn)
fails here with the message index and role, before any training starts.
"""

from __future__ import annotations

import json
from typing import Any

from services.chat.format import ChatFormat, hermes_tool_schema


class TemplateNotAppendOnly(ValueError):
    """The template rewrites text it rendered for earlier messages."""


def probe_conversation(fmt: ChatFormat, turns: int = 8) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Compute 2**10 with code, then answer."}]
    for t in range(turns):
        if fmt.tool_format == "hermes":
            call = {"type": "function", "function": {"name": fmt.tool_name,
                                                     "arguments": json.dumps({"code": f"print(2**{t})"})}}
            msgs.append({"role": "assistant", "content": f"Step {t}.", "tool_calls": [call]})
        else:
            msgs.append({"role": "assistant", "content": f"Step {t}.\n<code>\nprint(2**{t})\n</code>"})
        msgs.append({"role": "tool", "content": str(2**t)})
    msgs.append({"role": "assistant", "content": "<answer>\\boxed{1024}</answer>"})
    return msgs


def check_append_only(tokenizer: Any, fmt: ChatFormat, turns: int = 8) -> None:
    """Raise ``TemplateNotAppendOnly`` naming the first message whose rendering is not append-only."""
    msgs = probe_conversation(fmt, turns)
    kwargs: dict[str, Any] = {"tokenize": False}
    if fmt.tool_format == "hermes":
        kwargs["tools"] = [hermes_tool_schema(fmt.tool_name)]

    def text(k: int, gen: bool) -> str:
        return str(tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=gen, **kwargs))

    prev = text(1, False)
    for k in range(1, len(msgs)):
        role = msgs[k]["role"]
        cur = text(k + 1, False)
        if role == "assistant":
            head = text(k, True)
            if not head.startswith(prev):
                raise TemplateNotAppendOnly(f"chat template is not append-only: the generation prompt before "
                                            f"message {k} ({role}, turn {k // 2}) rewrites earlier text")
            if not cur.startswith(head):
                raise TemplateNotAppendOnly(f"chat template is not append-only at message {k} ({role}, "
                                            f"turn {k // 2}): it does not continue its generation prompt")
        if not cur.startswith(prev):
            at = next((i for i, (a, b) in enumerate(zip(prev, cur, strict=False)) if a != b), len(cur))
            raise TemplateNotAppendOnly(f"chat template is not append-only at message {k} ({role}, turn "
                                        f"{k // 2}): earlier text changes at character {at}: "
                                        f"{prev[at:at + 40]!r}")
        prev = cur
