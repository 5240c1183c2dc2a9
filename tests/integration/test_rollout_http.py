"""``POST /v1/rollouts`` (JSON and SSE), 422s, /healthz and /metrics of the rollout app.

The app runs in-process (ASGI) on a scripted engine so the tool path is deterministic; the
sandbox and reward services it calls are real servers on loopback. The same app on a real
model, as a real ``retool rollout serve`` subprocess, is tested in test_rollout_serve.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from services.rollout.config import RolloutConfig
from services.rollout.server import create_app
from tests.helpers import agent_fixtures
from tests.helpers.agent_fixtures import ScriptedEngine, make_tokenizer

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
