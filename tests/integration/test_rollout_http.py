"""``POST /v1/rollouts`` (JSON and SSE), 422s, /healthz and /metrics of the rollout app.

The app runs in-process (ASGI) on a scripted engine so the tool path is deterministic; the
sandbox and reward services it calls are real servers on loopback. The same app on a real
model, as a real ``retool rollout serve`` subprocess, is tested in test_rollout_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from services.common.process import free_port
from services.rollout.config import RolloutConfig
from services.rollout.server import create_app
from tests.helpers import agent_fixtures
from tests.helpers.agent_fixtures import EndlessEngine, ScriptedEngine, make_tokenizer

pytestmark = pytest.mark.integration
reward_url = agent_fixtures.reward_url  # a real reward service (session fixture)

TOK = make_tokenizer()
MESSAGES = [{"role": "user", "content": "What is 6*7?"}]
SCRIPT = {
    0: ["<code>print(6*7)</code>", "<answer>\\boxed{42}</answer>"],
    1: ["I think <answer>\\boxed{41}</answer>"],
}


@pytest.fixture
async def client(
    sandbox_url: str, reward_url: str
) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedEngine]]:
    cfg = RolloutConfig(sandbox_url=sandbox_url, reward_url=reward_url, max_n=4, model="scripted")
    engine = ScriptedEngine(TOK, {k: list(v) for k, v in SCRIPT.items()}, version=3)
    app = create_app(cfg, engine, TOK)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rollout") as c:
            yield c, engine


async def test_rollouts_json(client) -> None:
    c, _ = client
    r = await c.post(
        "/v1/rollouts",
        json={
            "messages": MESSAGES,
            "ground_truth": "42",
            "n": 2,
            "sampling": {"temperature": 0.8, "seed": 1},
            "max_turns": 4,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    t0, t1 = body["trajectories"]
    assert "\n<interpreter>\n42\n</interpreter>\n" in t0["response_text"]  # the real sandbox ran it
    assert (t0["reward"], t0["correct"], t0["tool_calls"]) == (1.0, True, 1)
    assert (t1["reward"], t1["correct"], t1["extracted"]) == (-1.0, False, "41")
    assert body["min_version"] == body["max_version"] == 3
    for t in (t0, t1):
        assert len(t["response_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) == len(t["versions"])
        assert TOK.decode(t["response_ids"]) == t["response_text"]
    assert TOK.decode(body["prompt_ids"]).startswith("<|im_start|>user\nWhat is 6*7?")

    metrics = (await c.get("/metrics")).text
    assert 'rollout_tool_calls_total{outcome="ok"} 1.0' in metrics
    assert "rollout_weight_version 3.0" in metrics
    gen = sum(sum(t["loss_mask"]) for t in (t0, t1))
    assert f"rollout_generated_tokens_total {float(gen)}" in metrics
    assert 'rollout_trajectories_total{reason="answer"} 2.0' in metrics
    assert "rollout_turns_bucket" in metrics and "rollout_sandbox_seconds_count 1.0" in metrics
    health = (await c.get("/healthz")).json()
    assert health["status"] == "ok" and health["weight_version"] == 3


def _parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


async def test_rollouts_stream(client) -> None:
    c, _ = client
    async with c.stream("POST", "/v1/rollouts", json={"messages": MESSAGES, "n": 1, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join([chunk async for chunk in r.aiter_text()])
    events = _parse_sse(text)
    kinds = [k for k, _ in events]
    assert kinds[-2:] == ["done", "end"] and kinds.index("tool_call") < kinds.index("tool_result")
    assert dict(events)["tool_call"]["code"] == "print(6*7)"
    assert dict(events)["tool_result"] == {"index": 0, "text": "42", "error": False}
    traj = dict(events)["done"]["trajectory"]
    streamed = [t for k, d in events if k == "token" for t in d["token_ids"]]
    assert streamed == [t for t, m in zip(traj["response_ids"], traj["loss_mask"], strict=True) if m]
    assert traj["reward"] is None  # no ground truth: not scored


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"messages": MESSAGES, "n": 5}, ["body", "n"]),
        ({"messages": MESSAGES, "n": 0}, ["body", "n"]),
        ({"n": 1}, ["body"]),
        ({"messages": [{"role": "wizard", "content": "x"}]}, ["body", "messages", 0, "role"]),
        ({"messages": MESSAGES, "sampling": {"temperature": -1}}, ["body", "sampling", "temperature"]),
        ({"messages": MESSAGES, "sampling": {"top_p": 0}}, ["body", "sampling", "top_p"]),
        ({"messages": MESSAGES, "max_turns": -1}, ["body", "max_turns"]),
        ({"messages": MESSAGES, "bogus": 1}, ["body", "bogus"]),
        ({"prompt_ids": [65] * 4097}, ["body", "prompt_ids"]),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, ["body", "messages"]),
    ],
)
async def test_bad_requests_are_422_naming_the_field(client, body: dict[str, Any], loc: list[Any]) -> None:
    c, engine = client
    r = await c.post("/v1/rollouts", json=body)
    assert r.status_code == 422, r.text
    assert any(d["loc"] == loc for d in r.json()["detail"]), r.json()
    assert engine.prompts == []  # nothing was generated


async def test_hermes_format_through_the_real_sandbox(sandbox_url: str) -> None:
    call = {"name": "code_interpreter", "arguments": {"code": "import math\nprint(math.factorial(5))"}}
    good = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    bad = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(\\d)"}}</tool_call>'
    cfg = RolloutConfig(sandbox_url=sandbox_url, model="scripted", agent={"tool_format": "hermes"})
    engine = ScriptedEngine(TOK, [bad, good, "It is 120."], version=1)
    app = create_app(cfg, engine, TOK)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://r") as c,
    ):
        r = await c.post("/v1/rollouts", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    (t,) = r.json()["trajectories"]
    assert engine.params[0].stop == ["</tool_call>", "</answer>"]
    assert "\n<tool_response>\nFailed to decode tool call: Invalid \\escape" in t["response_text"]
    assert "\n<tool_response>\n120\n</tool_response>\n" in t["response_text"]
    assert (t["tool_calls"], t["tool_errors"], t["finish_reason"]) == (2, 1, "eos")


def _gauge(metrics_text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", metrics_text, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


async def test_client_disconnect_mid_stream_cancels_the_generation() -> None:
    """A real HTTP server (uvicorn): closing the SSE connection mid-stream aborts the engine's requests
    and the request is no longer counted in flight; the server keeps serving."""
    cfg = RolloutConfig(sandbox_url="http://127.0.0.1:9", max_n=4, model="endless")
    engine = EndlessEngine(TOK)
    app = create_app(cfg, engine, TOK)  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serve = asyncio.create_task(server.serve())
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert not serve.done() and time.monotonic() < deadline, "uvicorn did not start"
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            body = {"messages": MESSAGES, "n": 2, "stream": True, "sampling": {"max_tokens": 100000}}
            async with c.stream("POST", "/v1/rollouts", json=body) as r:
                assert r.status_code == 200
                lines, tokens = r.aiter_lines(), 0  # kept open: a finalized iterator closes the response
                while tokens < 5:
                    tokens += await lines.__anext__() == "event: token"
                await asyncio.sleep(0.2)  # the client stops reading; the server keeps the stream open
                assert len(engine.running) == 2 and engine.closed == []
                assert (await c.get("/healthz")).json()["in_flight"] == 1
                assert _gauge((await c.get("/metrics")).text, "rollout_requests_in_flight") == 1
                await r.aclose()  # the client goes away mid-stream: httpx drops the unread connection
            while engine.running or (await c.get("/healthz")).json()["in_flight"]:
                assert time.monotonic() < deadline + 30, f"still generating: {engine.running}"
                await asyncio.sleep(0.05)
            assert len(engine.closed) == 2
            produced = engine.tokens
            await asyncio.sleep(0.3)
            assert engine.tokens == produced  # nothing generates any more
            text = (await c.get("/metrics")).text
            assert _gauge(text, "rollout_requests_in_flight") == 0
            assert _gauge(text, 'rollout_requests_total{outcome="error"}') == 1
            assert (await c.get("/healthz")).status_code == 200
    finally:
        server.should_exit = True
        await asyncio.wait_for(serve, 30)
