"""``/v1/chat/completions`` and ``/v1/models`` through the official ``openai`` client, against a real
``retool rollout serve`` on loopback (HF engine, tiny local model, real sandbox, real weight push).

The tool-call round trip is honest: a random tiny model never writes a tool call, so the model is
first fine-tuned for a few hundred steps (``imprint``) on one hermes trace -- prompt, a
``<tool_call>``, the tool result as the chat template writes it, a final answer. The served engine
then really generates the call; the server parses it into ``tool_calls``; the client runs it in the
real sandbox and sends the result back as a ``role: tool`` message with the assistant turn's
``token_ids``. The replica runs the agent loop with ``result_template`` set to the chat template's
rendering of a tool result, so ``/v1/rollouts`` (the agent loop) on the same replica, with the
same seed, must produce exactly the tokens the OpenAI conversation produced.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from openai import AsyncOpenAI, OpenAI

from services.chat.format import hermes_tool_schema
from services.common.process import ServiceProcess, free_port
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import RolloutConfig
from services.rollout.openai_api.render import chat_tool_result_template
from services.rollout.server import create_app
from services.transport.sandbox.client import SandboxClient
from tests.helpers.agent_fixtures import EndlessEngine, make_tokenizer

pytestmark = pytest.mark.integration

TOKEN = "openai-test-weight-token-3f9c"
VERSION = 3  # pushed before the tests: every generated token must carry it
TOOLS = [hermes_tool_schema("code_interpreter")]
QUESTION = [{"role": "user", "content": "What is 6*7? Use the tool."}]
CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
ANSWER = "The answer is 42."
SEED = 11
BUDGET = 256


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, sandbox_url: str) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    from tests.helpers.tiny_model import imprint, tiny_model_dir

    base = tiny_model_dir(tmp_path_factory)
    tok = AutoTokenizer.from_pretrained(base)
    template = chat_tool_result_template(tok, TOOLS)

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    prompt = enc(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True, tools=TOOLS))
    trace = prompt + enc(CALL) + enc(template.replace("{output}", "42")) + enc(ANSWER) + [tok.eos_token_id]
    model_dir = imprint(base, tmp_path_factory.mktemp("imprinted"), [(trace, len(prompt))])

    work = tmp_path_factory.mktemp("rollout-openai")
    cfg = work / "rollout.json"
    cfg.write_text(json.dumps({"max_n": 4, "agent": {"tool_format": "hermes", "result_template": template}}))
    grpc_port = free_port()
    args = ["rollout", "serve", "--model", str(model_dir), "--sandbox-url", sandbox_url, "--config", str(cfg),
            "--grpc-port", str(grpc_port), "--weight-token-env", "OPENAI_TEST_TOKEN"]
    with ServiceProcess(args, env={"OPENAI_TEST_TOKEN": TOKEN}, log_path=work / "rollout.log",
                        startup_timeout_s=120) as proc:
        from services.transport.weights.client import push_checkpoint

        push_checkpoint(str(model_dir), [f"127.0.0.1:{grpc_port}"], TOKEN, VERSION)
        client = OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield {"url": proc.url, "model": str(model_dir), "client": client, "tok": tok, "template": template}


async def run_tool(call: Any, sandbox_url: str) -> str:
    """What the harness does with a tool call: run its code in the sandbox (the agent loop's client)."""
    assert call.type == "function" and call.function.name == "code_interpreter"
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    try:
        return (await sandbox.run(json.loads(call.function.arguments)["code"])).text
    finally:
        await sandbox.aclose()


def test_models_lists_the_served_model_and_its_policy_version(served) -> None:
    client: OpenAI = served["client"]
    (card,) = client.models.list().data
    assert card.id == served["model"] and card.object == "model"
    assert card.model_extra["policy_version"] == VERSION
    assert client.models.retrieve(served["model"]).model_extra["policy_version"] == VERSION
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


async def test_tool_call_round_trip_equals_the_agent_loop(served, sandbox_url: str) -> None:
    client: OpenAI = served["client"]
    tok = served["tok"]
    common = {"model": served["model"], "tools": TOOLS, "stop": ["</answer>"], "temperature": 1.0,
              "extra_body": {"return_token_ids": True}}
    first = client.chat.completions.create(messages=QUESTION, n=2, seed=SEED, max_completion_tokens=BUDGET,
                                           **common)
    assert [c.index for c in first.choices] == [0, 1]
    p1 = first.model_extra["prompt_token_ids"]
    conversations = []
    for choice in first.choices:
        # the imprinted model writes the call; the server turned it into an OpenAI tool call
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert json.loads(call.function.arguments) == {"code": "print(6*7)"}
        assert choice.message.content is None
        gen1 = choice.model_extra["token_ids"]
        assert tok.decode(gen1) == CALL  # ids as generated, the stop string's tokens kept
        assert choice.model_extra["token_versions"] == [VERSION] * len(gen1)
        result = await run_tool(call, sandbox_url)
        assert result == "42"  # the real sandbox ran the model's code
        assistant = {**choice.message.model_dump(exclude_none=True), "token_ids": gen1}
        messages = [*QUESTION, assistant, {"role": "tool", "tool_call_id": call.id, "content": result}]
        second = client.chat.completions.create(
            messages=messages, n=1, seed=SEED + choice.index + 1_000_003,  # the agent loop's turn-1 seed
            max_completion_tokens=BUDGET - len(gen1), **common)
        (reply,) = second.choices
        assert (reply.finish_reason, reply.message.content) == ("stop", ANSWER)
        p2 = second.model_extra["prompt_token_ids"]
        assert p2[: len(p1) + len(gen1)] == p1 + gen1  # continued from exactly those tokens
        tool_ids = p2[len(p1) + len(gen1) :]
        assert tok.decode(tool_ids) == served["template"].replace("{output}", "42")
        said = reply.message.model_dump(exclude_none=True)
        conversations.append((choice, reply, tool_ids, [*messages, said]))

    # the agent loop on the same replica, same prompt and seed, lays out the same tokens
    r = httpx.post(f"{served['url']}/v1/rollouts", timeout=120, json={
        "messages": QUESTION, "n": 2, "sampling": {"temperature": 1.0, "seed": SEED, "max_tokens": BUDGET}})
    assert r.status_code == 200, r.text
    group = r.json()
    assert group["prompt_ids"] == p1
    for (choice, reply, tool_ids, _), traj in zip(conversations, group["trajectories"], strict=True):
        gen1, gen2 = choice.model_extra["token_ids"], reply.model_extra["token_ids"]
        assert traj["response_ids"] == gen1 + tool_ids + gen2
        assert traj["loss_mask"] == [1] * len(gen1) + [0] * len(tool_ids) + [1] * len(gen2)
        assert traj["versions"] == [VERSION] * len(gen1) + [-1] * len(tool_ids) + [VERSION] * len(gen2)
        lp1, lp2 = choice.model_extra["token_logprobs"], reply.model_extra["token_logprobs"]
        lps = lp1 + [0.0] * len(tool_ids) + lp2
        assert traj["logprobs"] == pytest.approx(lps, abs=1e-4)
        assert (traj["tool_calls"], traj["finish_reason"]) == (1, "eos")

    # a third turn after an EOS-terminated one: the template's own end of turn is not doubled
    choice, reply, _, messages = conversations[0]
    messages[-1]["token_ids"] = reply.model_extra["token_ids"]
    third = client.chat.completions.create(messages=[*messages, {"role": "user", "content": "Thanks!"}],
                                           max_completion_tokens=4, **common)
    p2 = p1 + choice.model_extra["token_ids"] + conversations[0][2]
    gen2 = reply.model_extra["token_ids"]
    assert gen2[-1] == tok.eos_token_id
    user_turn = tok.encode("\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)
    assert third.model_extra["prompt_token_ids"] == p2 + gen2 + user_turn


def test_sampled_choices_equal_the_agent_loop_samples(served) -> None:
    """On a prompt the model was not trained on (so every token depends on the seed), choice i of a
    chat completion is sample i of /v1/rollouts: same seeds, same tokens, log-probs and versions."""
    messages = [{"role": "user", "content": "Count the primes below 30."}]
    chat = served["client"].chat.completions.create(
        model=served["model"], messages=messages, n=3, seed=SEED, temperature=1.0, max_completion_tokens=12,
        stop=["</answer>"], extra_body={"return_token_ids": True})
    r = httpx.post(f"{served['url']}/v1/rollouts", timeout=120, json={
        "messages": messages, "n": 3, "max_turns": 0,
        "sampling": {"temperature": 1.0, "seed": SEED, "max_tokens": 12}})
    assert r.status_code == 200, r.text
    group = r.json()
    assert chat.model_extra["prompt_token_ids"] == group["prompt_ids"]
    assert len({tuple(c.model_extra["token_ids"]) for c in chat.choices}) == 3
    for choice, traj in zip(chat.choices, group["trajectories"], strict=True):
        assert choice.model_extra["token_ids"] == traj["response_ids"]
        assert choice.model_extra["token_logprobs"] == pytest.approx(traj["logprobs"], abs=1e-4)
        assert choice.model_extra["token_versions"] == traj["versions"]


def _sse_payloads(url: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_stream_equals_the_non_streamed_completion(served) -> None:
    client: OpenAI = served["client"]
    body: dict[str, Any] = {"model": served["model"], "messages": QUESTION, "tools": TOOLS, "n": 2, "seed": 5,
                            "logprobs": True, "max_completion_tokens": 64}
    whole = client.chat.completions.create(**body, extra_body={"return_token_ids": True})
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    for choice in whole.choices:
        parts = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == choice.index]
        assert parts[0].delta.role == "assistant"
        content = "".join(p.delta.content or "" for p in parts)
        calls = [tc for p in parts for tc in p.delta.tool_calls or []]
        assert content == (choice.message.content or "")
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert [p.finish_reason for p in parts][-1] == choice.finish_reason == "tool_calls"
        ids = [t for p in parts for t in p.model_extra.get("token_ids", [])]
        assert ids == choice.model_extra["token_ids"]
        streamed_lps = [e.logprob for p in parts if p.logprobs for e in p.logprobs.content]
        assert streamed_lps == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-4)
        assert streamed_lps == pytest.approx(choice.model_extra["token_logprobs"], abs=1e-4)
    # the wire format itself: OpenAI chunk objects, terminated by `data: [DONE]`
    raw = _sse_payloads(served["url"], {**body, "stream": True, "max_completion_tokens": 8, "tools": None})
    assert {p["object"] for p in raw} == {"chat.completion.chunk"}


def test_plain_requests_get_plain_openai_objects(served) -> None:
    """Without the opt-in, no extension field appears; n, seed and max_tokens are honoured."""
    body = {"model": served["model"], "messages": [{"role": "user", "content": "Say something."}], "n": 3,
            "seed": 1, "max_tokens": 6, "temperature": 1.0}
    r = httpx.post(f"{served['url']}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert set(data) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert data["system_fingerprint"] == f"retool-policy-v{VERSION}"
    for c in data["choices"]:
        assert set(c) == {"index", "message", "logprobs", "finish_reason"}
        assert set(c["message"]) == {"role", "content", "refusal"}
    usage = data["usage"]
    assert 3 <= usage["completion_tokens"] <= 3 * 6 and usage["total_tokens"] == sum(usage.values()) // 2
    again = served["client"].chat.completions.create(**body)
    assert [c.message.content for c in again.choices] == [c["message"]["content"] for c in data["choices"]]
    assert len({c.message.content for c in again.choices}) > 1  # seed + i: the choices differ


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
        ({"n": 5}, "n"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"temperature": 3}, "temperature"),
        ({"stop": ["a", ""]}, "stop"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [*QUESTION, {"role": "assistant", "token_ids": [10**9]}]}, "messages[1].token_ids"),
        ({"messages": [{"role": "user", "content": "x", "token_ids": [1]}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x" * 20000}]}, "messages"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(served, kwargs: dict[str, Any], param: str) -> None:
    client: OpenAI = served["client"]
    args = {"model": served["model"], "messages": QUESTION, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == 400
    assert info.value.param == param, info.value.body
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["message"]


def test_unknown_model_is_a_404(served) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        served["client"].chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_metrics_count_openai_requests(served) -> None:
    served["client"].chat.completions.create(model=served["model"], messages=QUESTION, max_tokens=2)
    text = httpx.get(f"{served['url']}/metrics", timeout=30).text
    name = 'rollout_openai_requests_total{outcome="ok"}'
    ok = [line for line in text.splitlines() if line.startswith(name)]
    assert ok and float(ok[0].split()[-1]) > 0
    assert "rollout_generated_tokens_total" in text


async def test_shared_limit_429_and_disconnect_cancels_generation() -> None:
    """One in-flight count for both APIs (max_concurrent_requests=1): while a chat stream runs, another
    chat request and a /v1/rollouts request get 429s; closing the stream mid-way (the official
    client's ``close``) aborts the engine request and frees the slot. In-process uvicorn on loopback,
    an engine that never stops (so the stream is open for as long as the test needs)."""
    tok = make_tokenizer()
    cfg = RolloutConfig(sandbox_url="http://127.0.0.1:9", model="endless", max_concurrent_requests=1)
    engine = EndlessEngine(tok)
    app = create_app(cfg, engine, tok)  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serve = asyncio.create_task(server.serve())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert not serve.done() and time.monotonic() < deadline, "uvicorn did not start"
            await asyncio.sleep(0.05)
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        stream = await client.chat.completions.create(model="endless", messages=QUESTION, stream=True)
        parts = stream.__aiter__()
        seen = ""
        while len(seen) < 5:
            seen += (await parts.__anext__()).choices[0].delta.content or ""
        assert set(seen) == {"a"} and len(engine.running) == 1
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model="endless", messages=QUESTION)
        assert "max_concurrent_requests=1" in info.value.message
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            assert (await c.post("/v1/rollouts", json={"messages": QUESTION})).status_code == 429
            await stream.close()  # the client goes away mid-stream
            while engine.running or (await c.get("/healthz")).json()["in_flight"]:
                assert time.monotonic() < deadline + 60, f"still generating: {engine.running}"
                await asyncio.sleep(0.05)
            assert len(engine.closed) == 1
            text = (await c.get("/metrics")).text
        assert 'rollout_openai_requests_total{outcome="rejected"} 1.0' in text
        assert 'rollout_openai_requests_total{outcome="error"} 1.0' in text  # the abandoned stream
        assert "rollout_requests_in_flight 0.0" in text
    finally:
        server.should_exit = True
        await asyncio.wait_for(serve, 30)
