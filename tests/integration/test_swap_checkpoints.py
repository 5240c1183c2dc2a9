"""Mid-turn checkpoints at a weight swap (issue 36): real Redis, real sandbox; a scripted engine.

The engine writes each turn's script in chunks and bumps its version with ``load_weights`` while a
turn is held between two chunks (a swap in the middle of a generation). The replica that saw the
swap "dies" (its task is cancelled while the engine holds it further on); another agent continues
the sample from the mid-turn checkpoint: the turn's tokens before the cut are kept as they were, the
engine is asked only for the rest of the turn, and the tool call opened before the cut and closed
after it runs. Also: no checkpoint cuts a stop string, a drain does not stop a turn resumed
mid-turn, and a meta written before ``turn_start`` existed resumes at its turn boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest

from services.common.queue import connect
from services.common.schemas import Trajectory
from services.rollout.agent.checkpoint import JobCheckpoints
from services.rollout.agent.drain import SampleDrained
from services.rollout.agent.loop import AgentLoop
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import AgentConfig
from services.rollout.engine.base import GenerationChunk, SamplingParams
from services.transport.sandbox.client import SandboxClient
from tests.helpers.agent_fixtures import make_tokenizer
from tests.helpers.engines import scripted_chunk

pytestmark = pytest.mark.integration
TOK = make_tokenizer()  # byte-level, no merges: one token per character of these ASCII scripts
KEY = "s:prompts:ckpt:job"
TURN0 = "Let me compute the product first.\n<code>total = 6 * 7\nprint(total)</code>"
SCRIPT = {0: [TURN0, "So <answer>\\boxed{42}</answer>"]}
CHUNK = 4


class SwapEngine:
    """Sample ``i`` turn ``t`` writes ``scripts[i][t]`` (EOS when the script is out) in chunks of
    ``chunk`` tokens, continuing a turn whose first tokens already end the context (the continuation
    of a mid-turn checkpoint). ``holds[(i, t, k)]``: before the chunk that starts at the turn's token
    ``k``, wait for the event (forever when it is never set). ``requests``: (i, t, tokens of the turn
    that were already in the context) per request."""

    def __init__(self, scripts: dict[int, list[str]], version: int,
                 holds: dict[tuple[int, int, int], asyncio.Event] | None = None, chunk: int = CHUNK) -> None:
        self.scripts, self.version, self.holds, self.chunk = scripts, version, holds or {}, chunk
        self.requests: list[tuple[int, int, int]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[GenerationChunk]:
        index, turn = int(request_id.split("-")[-2]), int(request_id.split("-")[-1][1:])
        script = self.scripts[index]
        text = script[turn] if turn < len(script) else ""
        ids = TOK.encode(text, add_special_tokens=False)
        stop_str = next((s for s in params.stop if text.endswith(s)), None)
        if stop_str is None:
            ids.append(TOK.eos_token_id)
        done = next((k for k in range(len(ids) - 1, 0, -1) if prompt_ids[-k:] == ids[:k]), 0)
        self.requests.append((index, turn, done))
        for k in range(done, len(ids), self.chunk):
            if (hold := self.holds.get((index, turn, k))) is not None:
                await hold.wait()
            part, last = ids[k:k + self.chunk], k + self.chunk >= len(ids)
            yield scripted_chunk(part, [_lp(k + j) for j in range(len(part))], self.version, last, stop_str)
            await asyncio.sleep(0)

    async def load_weights(self, named_tensors: Any, version: int) -> None:
        self.version = version

    async def shutdown(self) -> None:
        return None


def _lp(position: int) -> float:
    return float(np.float32(-0.25 - 0.001 * position))  # float32 already: kept exactly by a checkpoint


def _agent(engine: SwapEngine, sandbox: SandboxTool) -> AgentLoop:
    return AgentLoop(engine, TOK, sandbox, AgentConfig())  # type: ignore[arg-type]


def _prompt(agent: AgentLoop) -> list[int]:
    return agent.build_prompt([{"role": "user", "content": "What is 6 * 7?"}])


async def _saved(client: Any) -> JobCheckpoints:
    ckpt = JobCheckpoints(client, KEY, ttl_s=60, max_staleness=1)
    await ckpt.load()
    return ckpt


async def _until(cond: Any, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def _replica_dies_after(client: Any, sandbox: SandboxTool, scripts: dict[int, list[str]], *,
                              swap_at: int | None, die_at: tuple[int, int], length: int, chunk: int = CHUNK,
                              ) -> JobCheckpoints:
    """Run sample 0 at version 5 on an agent whose engine swaps to version 6 before turn 0's token
    ``swap_at`` (None: no swap) and then holds forever before token ``die_at[1]`` of turn
    ``die_at[0]``; once its (first) checkpoint is in Redis, the replica dies (cancelled). That
    checkpoint holds ``length`` tokens."""
    swap, never = asyncio.Event(), asyncio.Event()
    holds = {(0, *die_at): never} | ({} if swap_at is None else {(0, 0, swap_at): swap})
    engine = SwapEngine(scripts, 5, holds, chunk)
    agent = _agent(engine, sandbox)
    ckpt = JobCheckpoints(client, KEY, ttl_s=60, max_staleness=1)
    run = asyncio.create_task(agent.run_one(_prompt(agent), index=0, request_id="j", checkpoints=ckpt))
    if swap_at is not None:  # the engine holds before token swap_at: the agent has every token before it
        await _until(lambda: _true(0 in ckpt.live and len(ckpt.live[0].response_ids) == swap_at))
        await engine.load_weights(None, 6)
        swap.set()

    async def checkpointed() -> bool:
        assert not run.done(), run
        return 0 in (await _saved(client)).saved

    await _until(checkpointed)  # the first checkpoint is the last one: none is due before the hold
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    saved = await _saved(client)
    assert len(saved.saved[0].response_ids) == length, TOK.decode(saved.saved[0].response_ids)
    return saved


async def _reference(sandbox: SandboxTool, scripts: dict[int, list[str]]) -> Trajectory:
    """The same sample generated in one go by one replica, without checkpoints."""
    agent = _agent(SwapEngine(scripts, 6), sandbox)
    return await agent.run_one(_prompt(agent), index=0, request_id="j")


def _swap_point() -> int:
    """The first chunk boundary after ``<code>`` in turn 0: the swap lands inside the tool call."""
    after_tag = TURN0.index("<code>") + len("<code>")
    k = -(-after_tag // CHUNK) * CHUNK
    assert "</code>" not in TURN0[:k + 2 * CHUNK]  # the call is still open where the replica dies
    return k


async def test_swap_mid_turn_checkpoints_and_another_agent_finishes_the_turn(redis_server,
                                                                             sandbox_url) -> None:
    client = connect(redis_server.url)
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    k = _swap_point()
    ids = TOK.encode(TURN0, add_special_tokens=False)
    saved = await _replica_dies_after(client, sandbox, SCRIPT, swap_at=k, die_at=(0, k + 2 * CHUNK),
                                      length=k + CHUNK)
    ck = saved.saved[0]
    # (a) the checkpoint ends at the end of the first chunk after the swap: old versions, then new
    assert ck.response_ids == ids[:k + CHUNK] and ck.loss_mask == [1] * (k + CHUNK)
    assert ck.versions == [5] * k + [6] * CHUNK
    assert ck.logprobs == [_lp(j) for j in range(k + CHUNK)]
    assert (ck.turn_start, ck.turns, ck.tool_calls, ck.first_code_token) == (0, 0, 0, None)
    assert "<code>" in TOK.decode(ck.response_ids)  # the call was opened before the cut
    # staleness as any checkpoint: by its oldest kept token (5), not the newest (6)
    assert saved.resume_point(0, 7) is None and saved.observer.samples_restarted["stale"] == 1

    # (b) another agent continues: the kept tokens stay as they were, only the rest of turn 0 is asked
    kept = await _saved(client)
    engine = SwapEngine(SCRIPT, 6)
    agent = _agent(engine, sandbox)
    traj = await agent.run_one(_prompt(agent), index=0, request_id="j", checkpoints=kept)
    n = k + CHUNK
    assert engine.requests == [(0, 0, n), (0, 1, 0)]
    assert (traj.response_ids[:n], traj.versions[:n], traj.logprobs[:n]) == (
        ck.response_ids, ck.versions, ck.logprobs)
    assert set(traj.versions[n:]) == {-1, 6}
    assert (traj.turns, traj.tool_calls, traj.tool_errors, traj.finish_reason) == (2, 1, 0, "answer")
    assert "<interpreter>\n42\n</interpreter>" in (traj.response_text or "")  # the whole call ran
    ref = await _reference(sandbox, SCRIPT)
    assert traj.response_ids == ref.response_ids and traj.loss_mask == ref.loss_mask
    assert traj.first_code_token == ref.first_code_token == TURN0.index("<code>")  # from the turn's start
    assert (kept.observer.samples_resumed, kept.observer.tokens_resumed) == (1, n)
    await sandbox.aclose()
    await client.aclose()


async def test_a_drain_does_not_stop_a_turn_resumed_mid_turn(redis_server, sandbox_url) -> None:
    client = connect(redis_server.url)
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    k = _swap_point()
    await _replica_dies_after(client, sandbox, SCRIPT, swap_at=k, die_at=(0, k + 2 * CHUNK), length=k + CHUNK)
    engine = SwapEngine(SCRIPT, 6)
    agent = _agent(engine, sandbox)
    agent.draining.set()  # set before the sample starts: it still finishes its open turn
    with pytest.raises(SampleDrained):
        await agent.run_one(_prompt(agent), index=0, request_id="j", checkpoints=await _saved(client))
    assert engine.requests == [(0, 0, k + CHUNK)]
    ck = (await _saved(client)).saved[0]
    assert (ck.turns, ck.tool_calls, ck.turn_start, ck.finish) == (1, 1, None, None)  # a real boundary
    assert ck.response_ids == (await _reference(sandbox, SCRIPT)).response_ids[:len(ck.response_ids)]
    await sandbox.aclose()
    await client.aclose()


PROSE = {0: ["A </ is no stop.\n<code>print(1)</code>", "<answer>\\boxed{1}</answer>"]}


@pytest.mark.parametrize("where", ["prose", "stop"])
async def test_no_checkpoint_cuts_a_stop_string(redis_server, sandbox_url, where: str) -> None:
    """One token per chunk. "prose": the swap lands before ``</`` in the text; the turn ends with
    ``<`` then ``</`` there (proper prefixes of ``</code>``), so the checkpoint waits for the
    token after them. "stop": the swap lands before the closing ``</code>``: every chunk boundary
    left in the turn is inside the stop string, so the first checkpoint is the turn boundary's."""
    client = connect(redis_server.url)
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    text = PROSE[0][0]
    if where == "prose":
        at = text.index("</")
        saved = await _replica_dies_after(client, sandbox, PROSE, swap_at=at, die_at=(0, at + 6),
                                          length=at + 3, chunk=1)
        ck = saved.saved[0]
        assert TOK.decode(ck.response_ids).endswith("A </ ") and ck.turn_start == 0
        assert ck.versions == [5] * at + [6] * 3
    else:
        at = text.index("</code>")
        saved = await _replica_dies_after(client, sandbox, PROSE, swap_at=at, die_at=(1, 4),
                                          length=len(text) + len("\n<interpreter>\n1\n</interpreter>\n"),
                                          chunk=1)
        ck = saved.saved[0]
        assert (ck.turns, ck.turn_start) == (1, None)
        assert len(ck.segments) == 1  # no mid-turn checkpoint before it (it would be a segment of its own)
    await sandbox.aclose()
    await client.aclose()


async def test_a_meta_without_turn_start_resumes_at_its_turn_boundary(redis_server, sandbox_url) -> None:
    """A checkpoint written before ``turn_start`` existed (its meta lacks the key) is at a turn
    boundary: the next turn is asked for from its start and the response is as generated in one go."""
    client = connect(redis_server.url)
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    boundary = len(TURN0) + len("\n<interpreter>\n42\n</interpreter>\n")
    await _replica_dies_after(client, sandbox, SCRIPT, swap_at=None, die_at=(1, CHUNK), length=boundary)
    meta = msgpack.unpackb(await client.hget(KEY, "m0"))
    before = ("segments", "length", "turns", "tool_calls", "tool_errors", "tool_call_errors",
              "first_code_token", "finish")  # the meta's fields before turn_start
    old = {f: meta[f] for f in before}
    await client.hset(KEY, "m0", msgpack.packb(old, use_bin_type=True))
    kept = await _saved(client)
    assert (kept.saved[0].turn_start, kept.saved[0].turns) == (None, 1)
    engine = SwapEngine(SCRIPT, 5)
    agent = _agent(engine, sandbox)
    traj = await agent.run_one(_prompt(agent), index=0, request_id="j", checkpoints=kept)
    assert engine.requests == [(0, 1, 0)]
    ref = await _reference(sandbox, SCRIPT)
    assert (traj.response_ids, traj.first_code_token, traj.turns) == (
        ref.response_ids, ref.first_code_token, 2)
    await sandbox.aclose()
    await client.aclose()


async def _true(value: Any) -> bool:
    return bool(value)
