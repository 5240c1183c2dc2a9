"""``timeout_policy: drop`` end to end: reward service → rollout worker → trainer admission → ledger.

All real: a ``retool reward serve`` subprocess (``timeout_policy=drop``, and ``max_answer_chars=1``
so that an answer longer than twice its ground truth is cut off as a timeout, deterministically,
without waiting for a CPU limit), a Redis server, the Redis rollout worker with the real agent
loop and reward client, and the trainer's own ``_collect`` with its ledger. Only the token
stream is scripted (a random tiny model cannot be made to write a given answer); no tool is
called, so the sandbox client is never used.

Job ``a`` (truth ``4``) gets ``\\boxed{4}`` and ``\\boxed{444}``: the second grade times out, has
no reward, and the trainer drops the group with ledger reason ``reward_timeout``. Job ``b``
(truth ``123``) gets the same two answers, both wrong (not timeouts: ``444`` is within twice
``123``'s length): it is trained on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from services.common.process import ServiceProcess
from services.common.queue import RedisStream, connect
from services.common.schemas import PromptJob
from services.rollout.agent.loop import AgentLoop
from services.rollout.agent.sandbox import SandboxClient
from services.rollout.config import AgentConfig, RedisWorkerConfig
from services.rollout.metrics import grade_outcome
from services.rollout.worker import RolloutWorker
from services.trainer.config import TrainerConfig
from services.trainer.feed import DeadLetters, GroupReader, PromptFeeder
from services.trainer.ledger import LedgerWriter, check_file
from services.trainer.loop import RunConfig, Trainer
from services.trainer.staleness import StalenessManager
from services.transport.reward.client import RewardClient
from tests.helpers.agent_fixtures import ScriptedEngine, make_tokenizer

pytestmark = pytest.mark.integration
TOK = make_tokenizer()


@pytest.fixture(scope="module")
def drop_reward_url(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("reward") / "reward.log"
    args = ["reward", "serve", "--set", "workers=1", "--set", "timeout_policy=drop",
            "--set", "max_answer_chars=1"]
    with ServiceProcess(args, log_path=log) as proc:
        yield proc.url


def test_the_service_answers_a_timeout_with_no_reward(drop_reward_url):
    url = f"{drop_reward_url}/score"
    timed_out = httpx.post(url, json={"response": "\\boxed{444}", "ground_truth": "4"})
    graded = httpx.post(url, json={"response": "\\boxed{44}", "ground_truth": "4"})
    assert timed_out.status_code == graded.status_code == 200
    assert timed_out.json() | {"extracted": None} == {
        "score": None, "correct": False, "extracted": None, "reason": "timeout", "shaping": 0.0,
        "train": False,
    }
    assert graded.json()["score"] == -1.0 and graded.json()["train"] is True


async def _trainer(url: str, tcfg: TrainerConfig, jobs: list[PromptJob], ledger: Path) -> Trainer:
    trainer = Trainer(RunConfig(dataset="unused.parquet", trainer=tcfg, group_wait_s=60.0,
                                prompts_stream="prompts", groups_stream="groups"))
    trainer.redis = connect(url)
    groups = RedisStream(trainer.redis, "groups", "trainer")
    await groups.ensure_group()
    dead = RedisStream(trainer.redis, "prompts:dead", "trainer")
    await dead.ensure_group()
    trainer.manager = StalenessManager(tcfg.batch_prompts, tcfg.max_staleness)
    trainer.ledger = LedgerWriter(ledger)
    trainer.feeder = PromptFeeder(RedisStream(trainer.redis, "prompts"), jobs, trainer.manager,
                                  ledger=trainer.ledger)
    trainer.reader = GroupReader(groups, "trainer-0", trainer.manager)
    trainer.dead = DeadLetters(dead, "trainer-0")
    trainer.ledger.write("resume", step=0)
    return trainer


async def test_a_timed_out_grade_drops_its_group_with_a_ledger_reason(redis_server, drop_reward_url,
                                                                      tmp_path):
    tcfg = TrainerConfig(batch_prompts=1, group_size=2, mini_batch_size=2, max_staleness=1)
    tcfg.dynamic_sampling.enabled = False
    jobs = [PromptJob(job_id=j, prompt_ids=[1, 2], n=2, ground_truth=t)
            for j, t in (("a", "4"), ("b", "123"))]
    trainer = await _trainer(redis_server.url, tcfg, jobs, tmp_path / "ledger.jsonl")
    engine = ScriptedEngine(TOK, {0: ["\\boxed{4}"] * 2, 1: ["\\boxed{444}"] * 2})
    scorer = RewardClient(drop_reward_url, timeout_s=10.0)
    agent = AgentLoop(engine, TOK, SandboxClient("http://127.0.0.1:9"), AgentConfig(), scorer=scorer)
    wcfg = RedisWorkerConfig(url="unused", prompts_stream="prompts", groups_stream="groups", consumer="w1",
                             block_ms=100)
    worker_redis = connect(redis_server.url)
    worker = RolloutWorker(agent, RedisStream(worker_redis, "prompts", "rollout"),
                           RedisStream(worker_redis, "groups"), wcfg)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    trained: list[str] = []
    try:
        for step in (1, 2):
            payload = await trainer._collect()
            if payload == "used_up":
                break
            assert payload != "stop"
            job_ids = [g.job_id for g in payload.held.groups]
            assert all(r.reward == -1.0 for r in payload.rollouts)  # b's two wrong answers, never a None
            assert payload.stats["rollout/reward_timeouts"] == 0.0
            trained += job_ids
            trainer.manager.advance(step)
            trainer.ledger.trained(step, job_ids)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await scorer.aclose()
        await worker_redis.aclose()
    trainer.ledger.write("end", step=len(trained), outstanding=trainer.manager.in_flight(0))
    trainer.ledger.close()
    await trainer.redis.aclose()
    assert [j.split(":")[0] for j in trained] == ["b"]
    report = check_file(tmp_path / "ledger.jsonl")
    assert report.ok, report.violations
    assert report.dropped == {"reward_timeout": 1} and report.trained_groups == 1


def test_rollout_metrics_count_a_timeout_apart_from_a_wrong_answer():
    from services.common.schemas import Trajectory

    def traj(**kw) -> Trajectory:
        return Trajectory(index=0, response_ids=[1], loss_mask=[1], logprobs=[0.0], versions=[0],
                          finish_reason="eos", **kw)

    assert grade_outcome(traj(reward=None, correct=False, reward_reason="timeout")) == "timeout_dropped"
    assert grade_outcome(traj(reward=-1.0, correct=False, reward_reason="timeout")) == "timeout"
    assert grade_outcome(traj(reward=-1.0, correct=False, reward_reason="mismatch")) == "wrong"
    assert grade_outcome(traj(reward=-1.0, correct=False, reward_reason="no_answer")) == "no_answer"
    assert grade_outcome(traj(reward=1.0, correct=True, reward_reason="exact")) == "correct"
    assert grade_outcome(traj()) is None
