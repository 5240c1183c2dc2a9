"""``/v1/chat/completions`` with tools on the real Qwen2.5 template (official ``openai`` client,
in-process uvicorn on loopback, the transformers engine serving a scripted ``mini`` model with the
real 151,936-row vocabulary: greedy decoding writes a hermes call whose ``<tool_call>`` and
``</tool_call>`` are Qwen2.5's added tokens 151657 / 151658).

Checks: the prompt is the real template's rendering with its ``# Tools`` section; the call comes back
as an OpenAI ``tool_calls`` entry with the ids as generated (the stop token kept); the next turn,
with the tool result and the turn's ``token_ids``, starts with exactly the previous prompt + those
ids, and what follows is the real template's ``<tool_response>`` user turn.
"""

from __future__ import annotations

import json

import pytest
from openai import AsyncOpenAI

from services.rollout.config import RolloutConfig
from services.rollout.engine.hf import HFEngine
from services.rollout.server import create_app
from tests.helpers.qwen import qwen_scripted_dir
from tests.helpers.uvicorn_app import serving

pytestmark = pytest.mark.integration

CALL = '<tool_call>{"name":"python","arguments":{"src": "print(6*7)"}}</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python source.",
    "parameters": {"type": "object", "properties": {"src": {"type": "string"}}, "required": ["src"]}}}]
QUESTION = [{"role": "user", "content": "Compute 6*7 with the tool."}]


@pytest.mark.asyncio
async def test_tool_calls_round_trip_on_the_real_template(tmp_path_factory):
    model = qwen_scripted_dir(tmp_path_factory, CALL)
    engine = HFEngine(model)
    tok = engine.tokenizer
    cfg = RolloutConfig(sandbox_url="http://127.0.0.1:9", model="qwen-mini")
    app = create_app(cfg, engine, tok)  # type: ignore[arg-type]
    try:
        async with serving(app, start_timeout_s=120, stop_timeout_s=60) as base:
            client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                 timeout=120)
            common = {"model": "qwen-mini", "tools": TOOLS, "temperature": 0.0, "max_completion_tokens": 64,
                      "extra_body": {"return_token_ids": True}}
            first = await client.chat.completions.create(messages=QUESTION, **common)
            p1 = first.model_extra["prompt_token_ids"]
            expected = tok.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False,
                                               add_generation_prompt=True)
            assert p1 == tok.encode(expected, add_special_tokens=False)
            assert "# Tools" in expected and '"name": "python"' in expected
            (choice,) = first.choices
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            arguments = json.loads(call.function.arguments)
            assert (call.function.name, arguments) == ("python", {"src": "print(6*7)"})
            gen1 = choice.model_extra["token_ids"]
            assert gen1 == tok.encode(CALL, add_special_tokens=False)
            assert gen1[0] == 151657 and gen1[-1] == 151658
            assistant = {**choice.message.model_dump(exclude_none=True), "token_ids": gen1}
            result = {"role": "tool", "tool_call_id": call.id, "content": "42 数 😀"}
            messages = [*QUESTION, assistant, result]
            second = await client.chat.completions.create(messages=messages, **common)
            p2 = second.model_extra["prompt_token_ids"]
            assert p2[: len(p1) + len(gen1)] == p1 + gen1  # continued from exactly those ids
            tail = tok.decode(p2[len(p1) + len(gen1):])
            assert tail == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n42 数 😀\n</tool_response>"
                            "<|im_end|>\n<|im_start|>assistant\n")
            assert second.choices[0].finish_reason == "tool_calls"
    finally:
        await engine.shutdown()
