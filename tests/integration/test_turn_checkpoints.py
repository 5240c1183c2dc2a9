"""Turn checkpoints end to end: real Redis, real sandbox, real workers (in-process); a scripted engine.

A replica "dies" (its worker task is cancelled: no more heartbeats, its job stays pending) after at
least one turn boundary, in the middle of the next turn; a second replica re-claims the job and
continues each sample from its checkpoint. Also: a stale checkpoint restarts its sample, a
persistent session is rebuilt by replaying its cells (and a cell that answers differently restarts
the sample), and a drained sample stops at its next boundary while its siblings reach theirs.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common.queue import RedisStream, connect
from services.common.schemas import ChatMessage, Group, PromptJob
from services.rollout.agent.checkpoint import CheckpointObserver, JobCheckpoints, checkpoint_key
from services.rollout.agent.drain import SampleDrained
from services.rollout.agent.loop import AgentLoop
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import AgentConfig, RedisWorkerConfig
from services.rollout.engine.base import GenerationChunk, SamplingParams
from services.rollout.worker import RolloutWorker
from services.transport.sandbox.client import SandboxClient
from tests.helpers.agent_fixtures import make_tokenizer
from tests.helpers.engines import scripted_chunk

pytestmark = pytest.mark.integration
TOK = make_tokenizer()
PROMPTS, GROUPS = "c:prompts", "c:groups"
HANG_AFTER = 12  # tokens a dying replica generates in the turn it dies in


class TurnEngine:
    """Sample ``i`` turn ``t`` writes ``scripts[i][t]`` (EOS when the script is out), in chunks of 4.

    ``gates[(i, t)]``: that turn writes ``HANG_AFTER`` tokens, then waits for the event (forever when
    it is never set: a replica that dies mid-turn). ``requests`` records each (i, t) asked for."""

    def __init__(self, scripts: dict[int, list[str]], version: int,
                 gates: dict[tuple[int, int], asyncio.Event] | None = None) -> None:
        self.scripts, self.version, self.gates = scripts, version, gates or {}
        self.requests: list[tuple[int, int]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[GenerationChunk]:
        index, turn = int(request_id.split("-")[-2]), int(request_id.split("-")[-1][1:])
        self.requests.append((index, turn))
        script = self.scripts[index]
        text = script[turn] if turn < len(script) else ""
        ids = TOK.encode(text, add_special_tokens=False)
        stop_str = next((s for s in params.stop if text.endswith(s)), None)
        if stop_str is None:
            ids.append(TOK.eos_token_id)
        gate = self.gates.get((index, turn))
        for k in range(0, len(ids), 4):
            if gate is not None and k == HANG_AFTER:
                await gate.wait()
            part, last = ids[k:k + 4], k + 4 >= len(ids)
            lps = [-0.25 - 0.001 * (k + j) for j in range(len(part))]
            yield scripted_chunk(part, lps, self.version, last, stop_str)
            await asyncio.sleep(0)

    async def load_weights(self, named_tensors: Any, version: int) -> None:
        self.version = version

    async def shutdown(self) -> None:
        return None


LONG = "The value is forty-two, as computed above; checking once more gives the same result. "
SCRIPTS = {
    0: ["Compute it.\n<code>print(6 * 7)</code>", LONG + "So <answer>\\boxed{42}</answer>"],
    1: ["Try.\n<code>print(sum(range(10)))</code>", LONG + "<answer>\\boxed{45}</answer>"],
}


def _worker(client: Any, sandbox: SandboxTool, engine: TurnEngine, name: str,
            session: str = "stateless", **cfg: Any) -> RolloutWorker:
    agent = AgentLoop(engine, TOK, sandbox, AgentConfig(tool_session=session))  # type: ignore[arg-type]
    wcfg = RedisWorkerConfig(url="unused", prompts_stream=PROMPTS, groups_stream=GROUPS, consumer=name,
                             block_ms=50, claim_idle_ms=300, heartbeat_ms=50, drain_s=0, **cfg)
    return RolloutWorker(agent, RedisStream(client, PROMPTS, "rollout"), RedisStream(client, GROUPS), wcfg)


async def _until(cond: Any, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


DYING_REPLICA = """
import asyncio, sys
from services.common.queue import connect
from services.rollout.agent.sandbox import SandboxTool
from services.transport.sandbox.client import SandboxClient
from tests.integration import test_turn_checkpoints as t

async def main(redis_url, sandbox_url, scripts, session):
    never = asyncio.Event()  # every sample hangs HANG_AFTER tokens into its second turn
    engine = t.TurnEngine(getattr(t, scripts), 5, {(0, 1): never, (1, 1): never})
    worker = t._worker(connect(redis_url), SandboxTool(SandboxClient(sandbox_url)), engine, "a", session)
    await worker.run(asyncio.Event())

asyncio.run(main(*sys.argv[1:]))
"""


async def _kill_after_progress(client: Any, redis_url: str, sandbox_url: str, scripts: str, session: str,
                               key: str, n: int) -> dict[int, int]:
    """Run replica "a" (a process) until every sample is checkpointed and its heartbeat saw it
    ``HANG_AFTER`` tokens further; then SIGKILL it (its job stays pending). Returns that progress."""
    proc = subprocess.Popen([sys.executable, "-c", DYING_REPLICA, redis_url, sandbox_url, scripts, session])
    ckpt = JobCheckpoints(client, key, ttl_s=60, max_staleness=1)

    async def far_enough() -> bool:
        assert proc.poll() is None, f"replica a exited with {proc.returncode}"
        ckpt.saved.clear()
        ckpt.progress.clear()
        await ckpt.load()
        return all(i in ckpt.saved and ckpt.progress.get(i, 0) >= len(ckpt.saved[i].response_ids) + HANG_AFTER
                   for i in range(n))

    try:
        await _until(far_enough, timeout=60)
    finally:
        proc.kill()
        proc.wait(10)
    return dict(ckpt.progress)


async def _run_until_published(worker: RolloutWorker, groups: RedisStream) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))

    async def published() -> bool:
        assert not task.done(), task
        return await groups.depth() >= 1

    try:
        await _until(published)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def _job(n: int) -> PromptJob:
    return PromptJob(messages=[ChatMessage(role="user", content="What is 6 * 7?")], n=n, policy_version=5)


@pytest.mark.parametrize("b_version", [6, 7], ids=["continues", "stale-restarts"])
async def test_killed_replica_job_continues_from_the_last_turn_checkpoint(redis_server, sandbox_url,
                                                                          b_version: int) -> None:
    client = connect(redis_server.url)
    prompts, groups = RedisStream(client, PROMPTS, "rollout"), RedisStream(client, GROUPS)
    job = _job(2)
    key = checkpoint_key(PROMPTS, job.job_id)
    await prompts.add(job.to_msgpack())
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    progress = await _kill_after_progress(client, redis_server.url, sandbox_url, "SCRIPTS", "stateless",
                                          key, 2)
    kept = JobCheckpoints(client, key, ttl_s=60, max_staleness=1)
    await kept.load()
    assert {i: kept.saved[i].turns for i in (0, 1)} == {0: 1, 1: 1}  # one turn boundary each

    b_engine = TurnEngine(SCRIPTS, b_version)
    b = _worker(client, sandbox, b_engine, "b")
    await _run_until_published(b, groups)
    raw = await client.xrange(GROUPS)
    assert len(raw) == 1  # published once
    group = Group.from_msgpack(raw[0][1][b"d"])
    assert await client.exists(key) == 0  # deleted with the publish
    assert await prompts.pending() == 0 and b.stats.jobs_reclaimed == 1
    obs: CheckpointObserver = b.checkpoint_observer
    kept_len = {i: len(kept.saved[i].response_ids) for i in (0, 1)}
    for t in group.trajectories:
        assert (t.turns, t.tool_calls, t.finish_reason) == (2, 1, "answer")
        assert set(t.versions) <= {-1, 5, b_version}
    if b_version == 6:  # within max_staleness 1: every sample continues
        for t in group.trajectories:
            ck, n = kept.saved[t.index], kept_len[t.index]
            assert (t.response_ids[:n], t.versions[:n], t.logprobs[:n]) == (
                ck.response_ids, ck.versions, ck.logprobs)  # id for id, with the original versions
            assert set(t.versions[n:]) == {b_version}  # only what came after the checkpoint is new
        assert sorted(b_engine.requests) == [(0, 1), (1, 1)]  # the first turns were not generated again
        assert (group.min_version, group.max_version) == (5, 6)
        assert (obs.samples_resumed, obs.tokens_resumed) == (2, sum(kept_len.values()))
        assert obs.tokens_regenerated == sum(progress[i] - kept_len[i] for i in (0, 1)) >= 2 * HANG_AFTER
        assert obs.samples_restarted == {"stale": 0, "replay_mismatch": 0, "no_checkpoint": 0}
    else:  # version 7 is 2 ahead of the checkpoints' 5: they are discarded, the samples restart
        assert {v for t in group.trajectories for v in t.versions} == {-1, 7}
        assert sorted(b_engine.requests) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert obs.samples_restarted == {"stale": 2, "replay_mismatch": 0, "no_checkpoint": 0}
        assert obs.samples_resumed == 0
        # the discarded checkpoints' tokens apart from those lost past them to the kill
        assert obs.tokens_discarded == sum(kept_len.values())
        assert obs.tokens_regenerated == sum(progress[i] - kept_len[i] for i in (0, 1))
    await sandbox.aclose()
    await client.aclose()


REPLAY = {
    0: ["Set it.\n<code>x = 21\nprint(x)</code>", "Use it.\n<code>print(x * 2)</code>",
        "<answer>\\boxed{42}</answer>"],
    1: ["Draw.\n<code>import random\nprint(random.random())</code>", "Again.\n<code>print(1 + 1)</code>",
        "<answer>\\boxed{2}</answer>"],
}


async def test_a_started_sample_without_a_checkpoint_restarts_and_is_counted(redis_server) -> None:
    """A sample a dead replica had started (heartbeat progress) but not checkpointed restarts from its
    prompt, counted as ``no_checkpoint`` with its progress regenerated; one it had not started is new."""
    client = connect(redis_server.url)
    key = checkpoint_key("retool:prompts", "job-nock")
    await client.hset(key, mapping={"p0": 12})
    ckpt = JobCheckpoints(client, key, ttl_s=60, max_staleness=1, observer=CheckpointObserver())
    await ckpt.load()
    assert ckpt.resume_point(0, 3) is None and ckpt.resume_point(1, 3) is None
    obs = ckpt.observer
    assert obs.samples_restarted == {"stale": 0, "replay_mismatch": 0, "no_checkpoint": 1}
    assert (obs.tokens_regenerated, obs.samples_resumed) == (12, 0)
    await client.aclose()


async def test_persistent_session_is_replayed_and_a_differing_cell_restarts_its_sample(
        redis_server, sandbox_url) -> None:
    client = connect(redis_server.url)
    prompts, groups = RedisStream(client, PROMPTS, "rollout"), RedisStream(client, GROUPS)
    job = _job(2)
    key = checkpoint_key(PROMPTS, job.job_id)
    await prompts.add(job.to_msgpack())
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    await _kill_after_progress(client, redis_server.url, sandbox_url, "REPLAY", "persistent", key, 2)
    kept = JobCheckpoints(client, key, ttl_s=60, max_staleness=1)
    await kept.load()
    assert kept.saved[0].cells == [("x = 21\nprint(x)", "21")]

    b_engine = TurnEngine(REPLAY, 5)
    b = _worker(client, sandbox, b_engine, "b", "persistent")
    await _run_until_published(b, groups)
    group = Group.from_msgpack((await client.xrange(GROUPS))[0][1][b"d"])
    t0, t1 = group.trajectories
    # sample 0: its session was rebuilt by the replay (x is defined), only turn 1 on was generated
    assert "<interpreter>\n42\n</interpreter>" in (t0.response_text or "")
    assert t0.response_ids[:len(kept.saved[0].response_ids)] == kept.saved[0].response_ids
    # sample 1: the random cell answered differently, so it restarted from its prompt
    assert sorted(b_engine.requests) == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert (t1.tool_calls, t1.tool_errors, t1.finish_reason) == (2, 0, "answer")
    obs = b.checkpoint_observer
    assert obs.samples_restarted == {"stale": 0, "replay_mismatch": 1, "no_checkpoint": 0}
    assert obs.samples_resumed == 1
    await sandbox.aclose()
    await client.aclose()


async def test_drained_sample_stops_at_its_next_boundary_and_siblings_reach_theirs(redis_server,
                                                                                   sandbox_url) -> None:
    client = connect(redis_server.url)
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    scripts = {0: ["A.\n<code>print(1)</code>", "B.\n<code>print(2)</code>", "<answer>\\boxed{3}</answer>"],
               1: ["Done: <answer>\\boxed{3}</answer>"]}
    turn1, sibling = asyncio.Event(), asyncio.Event()
    engine = TurnEngine(scripts, 5, {(0, 1): turn1, (1, 0): sibling})
    agent = AgentLoop(engine, TOK, sandbox, AgentConfig())  # type: ignore[arg-type]
    prompt = agent.build_prompt([{"role": "user", "content": "1 + 2?"}])
    ckpt = JobCheckpoints(client, "c:ckpt:drain", ttl_s=60, max_staleness=1)
    run = asyncio.create_task(agent.run_group(prompt, 2, request_id="j", checkpoints=ckpt))
    await _until(lambda: _true((0, 1) in engine.requests and (1, 0) in engine.requests))
    agent.draining.set()  # mid-turn: sample 0 finishes turn 1, checkpoints it, then stops
    turn1.set()
    await _until(lambda: _true(0 in ckpt._saved_len and ckpt._lineage[0] and len(ckpt._lineage[0]) == 2))
    await asyncio.sleep(0.05)
    assert not run.done()  # the sibling was not cancelled: it is still in its turn
    sibling.set()
    with pytest.raises(SampleDrained):
        await asyncio.wait_for(run, 30)
    saved = JobCheckpoints(client, "c:ckpt:drain", ttl_s=60, max_staleness=1)
    await saved.load()
    assert (saved.saved[0].turns, saved.saved[0].tool_calls, saved.saved[0].finish) == (2, 2, None)
    assert (saved.saved[1].turns, saved.saved[1].finish) == (1, ("answer", False))
    # another replica continues: nothing before the checkpoints is generated again
    engine2 = TurnEngine(scripts, 5)
    agent2 = AgentLoop(engine2, TOK, sandbox, AgentConfig())  # type: ignore[arg-type]
    trajs = await agent2.run_group(prompt, 2, request_id="j", checkpoints=saved)
    assert engine2.requests == [(0, 2)]
    assert [(t.turns, t.finish_reason) for t in trajs] == [(3, "answer"), (1, "answer")]
    assert saved.observer.tokens_regenerated == 0 and saved.observer.samples_resumed == 2
    await sandbox.aclose()
    await client.aclose()


async def _true(value: Any) -> bool:
    return bool(value)
