"""The multi-turn agent loop driven by scripted token streams (a real byte-level HF tokenizer).

The tool runner here is a recording stand-in for the sandbox so the loop's logic is tested in
isolation; the real sandbox is exercised in tests/integration/test_rollout_agent.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.chat.tool_result import ToolResult
from services.common.process import free_port
from services.common.schemas import RolloutSampling, Trajectory
from services.rollout.agent.loop import AgentLoop, splits_a_stop
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import AgentConfig
from services.transport.sandbox.client import SandboxClient, SandboxUnavailable
from tests.helpers.agent_fixtures import ScriptedEngine, extra_token_id, make_tokenizer
from tests.helpers.masks import spans

TOK = make_tokenizer()
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


class RecordingTools:
    def __init__(self, outputs: list[ToolResult] | None = None) -> None:
        self.codes: list[str] = []
        self.outputs = list(outputs or [])

    async def run(self, code: str) -> ToolResult:
        self.codes.append(code)
        return self.outputs.pop(0) if self.outputs else ToolResult(f"ran {len(self.codes)}", False, 0.001)


def check_invariants(traj: Trajectory, interp_texts: list[str]) -> None:
    n = len(traj.response_ids)
    assert n == len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions)
    # masked tokens are exactly the interpreter blocks, tokenized on their own
    masked = [traj.response_ids[a:b] for a, b in spans(traj.loss_mask, 0)]
    assert [TOK.decode(ids) for ids in masked] == interp_texts
    for i in range(n):
        if traj.loss_mask[i] == 0:
            assert traj.logprobs[i] == 0.0 and traj.versions[i] == -1
        else:
            assert traj.logprobs[i] < 0.0 and traj.versions[i] >= 0
    assert TOK.decode(traj.response_ids) == traj.response_text


def _loop(script: list[Any], tools: Any = None, **cfg: Any) -> tuple[AgentLoop, ScriptedEngine, Any]:
    engine = ScriptedEngine(TOK, script, version=7)
    tools = tools or RecordingTools()
    return AgentLoop(engine, TOK, tools, AgentConfig(**cfg)), engine, tools


async def test_code_turn_then_answer() -> None:
    turn1 = "Let me compute.\n<code>\n```python\nprint(2+2)\n```\n</code>"
    turn2 = "So the answer is <answer>\\boxed{4}</answer>"
    loop, engine, tools = _loop([turn1, turn2 + " trailing text never generated"])
    prompt = loop.build_prompt(MESSAGES)
    assert TOK.decode(prompt).endswith("<|im_start|>assistant\n")
    traj = await loop.run_one(prompt, index=2, sampling=RolloutSampling(temperature=0.7, top_p=0.9, seed=5))
    assert tools.codes == ["print(2+2)"]
    assert [(p.seed, p.temperature, p.top_p) for p in engine.params] == [(7, 0.7, 0.9), (1_000_010, 0.7, 0.9)]
    interp = "\n<interpreter>\nran 1\n</interpreter>\n"
    assert traj.response_text == turn1 + interp + turn2
    assert (traj.finish_reason, traj.turns, traj.tool_calls, traj.tool_errors) == ("answer", 2, 1, 0)
    check_invariants(traj, [interp])
    # turn 2 continued from exactly prompt + the tokens so far (nothing re-tokenized)
    assert engine.prompts[0] == prompt
    assert engine.prompts[1] == prompt + traj.response_ids[: len(engine.prompts[1]) - len(prompt)]
    assert engine.params[0].stop == ["</code>", "</answer>"]
    assert set(traj.versions) == {7, -1}


async def test_stop_in_the_middle_of_a_token() -> None:
    # "...</co" + "de>\nAfter": the stop string ends inside a token, which is kept whole
    head = TOK.encode("<code>print(1)</co", add_special_tokens=False)
    mid = extra_token_id(TOK, "de>\nAfter")
    script = [
        head + [mid] + TOK.encode("IGNORED", add_special_tokens=False),
        TOK.encode("<code>print(2)", add_special_tokens=False) + [extra_token_id(TOK, "</code>\n\n")],
        "done",
    ]
    loop, engine, tools = _loop(script)
    traj = await loop.run_one(loop.build_prompt(MESSAGES))
    assert tools.codes == ["print(1)", "print(2)"]
    assert mid in traj.response_ids
    assert "IGNORED" not in traj.response_text
    assert traj.response_text.startswith("<code>print(1)</code>\nAfter\n<interpreter>")
    assert traj.finish_reason == "eos" and traj.response_ids[-1] == TOK.eos_token_id
    check_invariants(
        traj, ["\n<interpreter>\nran 1\n</interpreter>\n", "\n<interpreter>\nran 2\n</interpreter>\n"]
    )


async def test_hermes_malformed_json_becomes_tool_response_error() -> None:
    bad = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(\\sqrt(2))"}}</tool_call>'
    good = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}</tool_call>'
    loop, _, tools = _loop([bad, good, "final"], tool_format="hermes")
    traj = await loop.run_one(loop.build_prompt(MESSAGES))
    assert tools.codes == ["print(1)"]  # the malformed call never reached the sandbox
    assert (traj.tool_calls, traj.tool_errors, traj.finish_reason) == (2, 1, "eos")
    masked = [TOK.decode(traj.response_ids[a:b]) for a, b in spans(traj.loss_mask, 0)]
    assert masked[0].startswith("\n<tool_response>\nFailed to decode tool call: Invalid \\escape")
    assert masked[1] == "\n<tool_response>\nran 1\n</tool_response>\n"
    check_invariants(traj, masked)


async def test_max_turns_ends_the_response_without_running_the_extra_call() -> None:
    call = "<code>print('x')</code>"
    loop, _, tools = _loop([call, call, call, "never"], max_turns=2)
    traj = await loop.run_one(loop.build_prompt(MESSAGES))
    assert len(tools.codes) == 2
    assert (traj.finish_reason, traj.turns, traj.tool_calls, traj.truncated) == ("max_turns", 3, 2, False)
    assert traj.response_text.endswith(call)


async def test_token_budget_truncates_generation() -> None:
    loop, engine, _ = _loop(["a" * 500], max_response_tokens=64)
    traj = await loop.run_one(loop.build_prompt(MESSAGES))
    assert (traj.finish_reason, traj.truncated, len(traj.response_ids)) == ("length", True, 64)
    assert engine.params[0].max_tokens == 64


async def test_token_budget_cuts_an_interpreter_block_that_does_not_fit() -> None:
    turn1 = "<code>print(1)</code>"
    n1 = len(TOK.encode(turn1, add_special_tokens=False))
    loop, engine, _ = _loop([turn1, "more"], max_response_tokens=n1 + 5)
    traj = await loop.run_one(loop.build_prompt(MESSAGES))
    assert (traj.finish_reason, traj.truncated, len(traj.response_ids)) == ("length", True, n1 + 5)
    assert traj.loss_mask == [1] * n1 + [0] * 5
    assert len(engine.prompts) == 1
    # the per-request budget overrides the config
    loop2, engine2, _ = _loop([turn1, "more"], max_response_tokens=10_000)
    traj2 = await loop2.run_one(loop2.build_prompt(MESSAGES), sampling=RolloutSampling(max_tokens=n1 + 3))
    assert len(traj2.response_ids) == n1 + 3 and traj2.truncated


async def test_long_tool_output_is_truncated_in_the_middle() -> None:
    long = "BEGIN" + "0123456789" * 1000 + "END"
    tools = RecordingTools([ToolResult(long, False)])
    loop, _, _ = _loop(["<code>print(1)</code>", "ok"], tools=tools, max_tool_output_chars=300)
    traj = await loop.run_one(loop.build_prompt(MESSAGES))
    block = TOK.decode(traj.response_ids[slice(*spans(traj.loss_mask, 0)[0])])
    inner = block.removeprefix("\n<interpreter>\n").removesuffix("\n</interpreter>\n")
    assert len(inner) <= 300 and inner.startswith("BEGIN") and inner.endswith("END")


async def test_unreachable_sandbox_fails_the_rollout_loudly() -> None:
    # a real client against a loopback port nobody listens on: connection refused, retried, then
    # the rollout fails: an outage never becomes a "no tools" trajectory (ToRL #27)
    client = SandboxTool(SandboxClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01))
    try:
        loop, _, _ = _loop(["<code>print(1)</code>", "ok"], tools=client)
        with pytest.raises(SandboxUnavailable, match="after 2 attempts"):
            await loop.run_one(loop.build_prompt(MESSAGES))
    finally:
        await client.aclose()


async def test_stream_events_and_group() -> None:
    script = ["<code>print(1)</code>", "end", "<code>print(2)</code>", "end"]
    loop, _, _ = _loop(script)
    events: list[dict[str, Any]] = []

    async def sink(ev: dict[str, Any]) -> None:
        events.append(ev)

    trajs = await loop.run_group(loop.build_prompt(MESSAGES), 2, on_event=sink)
    assert [t.index for t in trajs] == [0, 1]
    for i in (0, 1):
        kinds = [e["type"] for e in events if e["index"] == i]
        assert kinds[-1] == "done" and kinds.count("tool_call") == 1 and kinds.count("tool_result") == 1
        assert kinds.index("tool_call") < kinds.index("tool_result")
        toks = [t for e in events if e["index"] == i and e["type"] == "token" for t in e["token_ids"]]
        gen = [t for t, m in zip(trajs[i].response_ids, trajs[i].loss_mask, strict=True) if m == 1]
        assert toks == gen


class RecordingScorer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    async def score(
        self, response: str, ground_truth: str, *, num_tool_calls: int = 0, data_source: str | None = None
    ) -> Any:
        self.calls.append((response, ground_truth, num_tool_calls))
        from services.transport.reward.schemas import ScoreResult

        return ScoreResult(score=1.0, correct=True, extracted="4", reason="stub")


@pytest.mark.parametrize("gt", [None, "4"])
async def test_reward_requested_only_with_ground_truth(gt: str | None) -> None:
    engine = ScriptedEngine(TOK, ["<code>print(1)</code>", "So\nAnswer: 4"])  # ends with EOS
    scorer = RecordingScorer()
    loop = AgentLoop(engine, TOK, RecordingTools(), AgentConfig(), scorer=scorer)
    traj = await loop.run_one(loop.build_prompt(MESSAGES), ground_truth=gt)
    if gt is None:
        assert scorer.calls == [] and traj.reward is None
    else:
        assert traj.response_text.endswith("Answer: 4<|im_end|>")
        # the grader gets the text without special tokens
        assert scorer.calls == [(traj.response_text.removesuffix("<|im_end|>"), "4", 1)]
        assert (traj.reward, traj.correct, traj.extracted) == (1.0, True, "4")


async def test_engine_context_caps_the_budget() -> None:
    loop, engine, _ = _loop(["b" * 500], max_response_tokens=1000)
    prompt = loop.build_prompt(MESSAGES)
    engine.max_context = len(prompt) + 21  # type: ignore[attr-defined]
    traj = await loop.run_one(prompt)
    assert (traj.finish_reason, traj.truncated, len(traj.response_ids)) == ("length", True, 20)
    assert engine.params[0].max_tokens == 20


class FailingEngine(ScriptedEngine):
    """Sample 0 fails in the engine; sample 1 would generate forever."""

    def __init__(self) -> None:
        super().__init__(TOK, [])
        self.cancelled = asyncio.Event()

    async def generate(self, prompt_ids, params, request_id):  # noqa: ANN001, ANN201
        if request_id.endswith("-0-t0"):
            raise RuntimeError("CUDA error: device lost")
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()
        yield  # pragma: no cover


async def test_a_failing_sample_fails_the_group_and_cancels_the_others() -> None:
    engine = FailingEngine()
    loop = AgentLoop(engine, TOK, RecordingTools(), AgentConfig())
    with pytest.raises(RuntimeError, match="device lost"):
        await asyncio.wait_for(loop.run_group(loop.build_prompt(MESSAGES), 2), 10)
    assert engine.cancelled.is_set()


async def test_per_call_errors_and_the_first_code_position() -> None:
    turn1 = "Think first.\n<code>print(comb(5, 2))</code>"
    turn2 = "<code>from math import comb\nprint(comb(5, 2))</code>"
    outs = [ToolResult("NameError: name 'comb' is not defined", True), ToolResult("10", False)]
    loop, _, _ = _loop([turn1, turn2, "<answer>10</answer>"], tools=RecordingTools(outs))
    traj = await loop.run_one(loop.build_prompt(MESSAGES))
    assert (traj.tool_calls, traj.tool_errors, traj.tool_call_errors) == (2, 1, [True, False])
    # the tokens before the first call's <code> decode to exactly the text before it
    assert traj.first_code_token is not None
    assert TOK.decode(traj.response_ids[: traj.first_code_token]) == "Think first.\n"
    none, _, _ = _loop(["<answer>4</answer>"])
    direct = await none.run_one(none.build_prompt(MESSAGES))
    assert (direct.tool_call_errors, direct.first_code_token) == ([], None)


def test_splits_a_stop() -> None:
    """A mid-turn checkpoint (at a weight swap) is never taken where the turn so far ends with a
    proper prefix of a stop string or an incomplete character: the continuation would miss the stop."""
    stops = ["</code>", "</answer>"]
    for text in ("x <", "x </", "x </co", "x </code", "x </ans", "x </answe"):
        assert splits_a_stop(text, stops), text
    for text in ("", "x", "x </code>", "x </answer>", "x </ ", "x </c!", "x < y", "x </coder"):
        assert not splits_a_stop(text, stops), text
    assert splits_a_stop("x \ufffd", stops)  # a token holding part of a character: wait for the rest
    assert not splits_a_stop("x <code>", ["</tool_call>"])
