"""The OpenAI API's pure parts: prompt rendering with spliced token ids, the tool-call decision,
held-back streaming text, request validation (400s naming the field)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from services.rollout.openai_api.completion import TOOL_STOP, GenerationAborted, decide
from services.rollout.openai_api.render import ChatRenderer, RenderError, chat_tool_result_template
from services.rollout.openai_api.router import _param
from services.rollout.openai_api.schemas import ChatCompletionRequest, ChatMessageIn
from services.rollout.openai_api.textstream import HeldText, IncrementalText
from tests.helpers.agent_fixtures import extra_token_id, make_tokenizer

TOK = make_tokenizer()
EOS = TOK.eos_token_id
USER = {"role": "user", "content": "What is 6*7?"}


def enc(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False))


def msgs(*raw: dict[str, Any]) -> list[ChatMessageIn]:
    return [ChatMessageIn.model_validate(m) for m in raw]


def test_render_without_token_ids_is_the_agent_loop_prompt() -> None:
    text = TOK.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    assert ChatRenderer(TOK).render(msgs(USER)) == enc(text)


def test_render_splices_the_exact_ids_of_an_assistant_turn() -> None:
    # "</tool_call>!" is one token the byte-level encoder never produces from text: re-tokenizing the
    # turn's text would change the ids, splicing must not
    odd = extra_token_id(TOK, "</tool_call>!")
    turn = enc('<tool_call>{"name": "f", "arguments": {}}') + [odd]
    assert enc(TOK.decode(turn)) != turn
    ids = ChatRenderer(TOK).render(
        msgs(USER, {"role": "assistant", "content": "ignored", "token_ids": turn},
             {"role": "tool", "content": "42", "tool_call_id": "c1"})
    )
    prompt = enc(TOK.apply_chat_template([USER], tokenize=False, add_generation_prompt=True))
    tail = enc("<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert ids == prompt + turn + tail


def test_a_turn_ending_in_eos_is_not_closed_twice() -> None:
    turn = enc("Hello.") + [EOS]
    ids = ChatRenderer(TOK).render(msgs(USER, {"role": "assistant", "token_ids": turn}, USER))
    prompt = enc(TOK.apply_chat_template([USER], tokenize=False, add_generation_prompt=True))
    assert ids == prompt + turn + enc("\n<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_tool_result_template_is_what_the_splice_appends() -> None:
    template = chat_tool_result_template(TOK)
    assert template == "<|im_end|>\n<|im_start|>tool\n{output}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([USER, {"role": "assistant", "token_ids": [len(TOK)]}], "messages[1].token_ids"),
        ([USER, {"role": "assistant", "token_ids": [-1]}], "messages[1].token_ids"),
        (
            [USER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}],
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_render_errors_name_the_field(messages: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(RenderError) as info:
        ChatRenderer(TOK).render(msgs(*messages))
    assert info.value.param == param


def test_a_template_that_rewrites_content_cannot_splice() -> None:
    tok = make_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    with pytest.raises(RenderError) as info:
        ChatRenderer(tok).render(msgs(USER, {"role": "assistant", "token_ids": enc("hi")}))
    assert info.value.param == "messages[1].token_ids" and "verbatim" in info.value.message


def test_a_template_error_is_a_messages_error() -> None:
    tok = make_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RenderError) as info:
        ChatRenderer(tok).render(msgs(USER))
    assert info.value.param == "messages" and "roles must alternate" in info.value.message


CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'
NAMES = frozenset({"code_interpreter"})


def test_decide_turns_a_valid_call_into_tool_calls() -> None:
    out = decide("Let me run it.\n" + CALL, "stop", TOOL_STOP, NAMES)
    assert out.finish_reason == "tool_calls" and out.content == "Let me run it.\n"
    assert out.tool_call is not None and out.tool_call.function.name == "code_interpreter"
    assert json.loads(out.tool_call.function.arguments) == {"code": "print(1)"}
    assert out.tool_call.id.startswith("call_")
    assert decide(CALL, "stop", TOOL_STOP, NAMES).content is None


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "code_interpreter", "arguments": {"code": "\\d"}}</tool_call>',  # bad JSON
        '<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>',  # not a declared function
        'no opening tag</tool_call>',
    ],
)
def test_decide_keeps_a_malformed_call_as_content(text: str) -> None:
    out = decide(text + "trailing", "stop", TOOL_STOP, NAMES)
    assert (out.finish_reason, out.tool_call, out.content) == ("stop", None, text)


def test_decide_cuts_user_stops_and_maps_finish_reasons() -> None:
    assert decide("x = 1</answer> more", "stop", "</answer>", None).content == "x = 1"
    # without tools, </tool_call> is an ordinary stop string
    assert decide("a</tool_call>b", "stop", TOOL_STOP, None).content == "a"
    assert decide("abc", "length", None, NAMES).finish_reason == "length"
    assert decide("abc", "eos", None, NAMES).finish_reason == "stop"
    with pytest.raises(GenerationAborted):
        decide("abc", "abort", None, None)


def stream_text(text: str, markers: list[str]) -> tuple[list[str], str]:
    """Feed ``text`` one token at a time; return the released pieces and the final decoded text."""
    inc, held = IncrementalText(TOK), HeldText(markers)
    pieces = [held.release(inc.add([t])) for t in enc(text)]
    pieces.append(held.release(inc.flush()))
    return pieces, inc.text, held  # type: ignore[return-value]


def test_streamed_content_holds_back_tool_calls_and_partial_characters() -> None:
    text = "é ok <tool_call>{}</tool_call>"
    pieces, decoded, held = stream_text(text, ["<tool_call>", TOOL_STOP])
    assert decoded == text
    assert "".join(pieces) == "é ok "  # nothing of the call, and no half character, was shown
    assert all("\ufffd" not in p for p in pieces)
    out = decide(decoded, "stop", TOOL_STOP, frozenset({"f"}))  # {} has no name: stays content
    assert "".join(pieces) + held.rest(out.content) == out.content


def test_streamed_content_never_shows_part_of_a_stop_string() -> None:
    text = "value <answer>42</answer>"
    pieces, decoded, held = stream_text(text, ["</answer>"])
    assert all("</" not in p for p in pieces)
    out = decide(decoded, "stop", "</answer>", None)
    assert "".join(pieces) == out.content == "value <answer>42"
    assert held.rest(out.content) == ""


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [USER]}, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "tool"}]}, "messages[0]"),
        ({"model": "m", "messages": [USER], "n": 0}, "n"),
        ({"model": "m", "messages": [USER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"model": "m", "messages": [USER], "tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
    ],
)
def test_validation_errors_point_at_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    assert _param(body, info.value.errors()[0]["loc"]) == param


def test_an_echoed_response_message_is_accepted() -> None:
    """What ``choice.message.model_dump()`` of the official client holds, plus our token ids."""
    echoed = {"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "token_ids": [1, 2],
              "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [USER, echoed]})
    assert req.messages[1].token_ids == [1, 2]
