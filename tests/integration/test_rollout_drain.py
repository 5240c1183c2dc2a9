"""SIGTERM drains a real rollout replica, and another one takes its jobs at once (issue 36, item 3).

Two ``retool rollout serve`` subprocesses on ``engine: synthetic`` (a modelled 20 ms per decode step
and real code blocks run by the real sandbox: a job is mid-generation when the signal lands), one
real Redis, ``claim_idle_ms`` at 600 s: a job taken within the test's deadlines was handed back,
not re-claimed. The replica that holds jobs gets SIGTERM: ``/healthz`` says ``draining`` (503) and
``/metrics`` still answers during the drain, ``/v1/rollouts`` is refused with a 503, it exits 0
within ``drain_s`` and a margin, the other replica takes the handed-back jobs first, every job's
group is published exactly once and nothing stays pending; the replica holding nothing then
exits 0 on SIGTERM too. A second SIGTERM during a (10 min) drain stops the replica at once, and
its job is still handed back.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import redis

from services.common.process import ServiceProcess
from services.common.schemas import ChatMessage, Group, PromptJob
from services.rollout.handback import HANDED_BACK

pytestmark = pytest.mark.integration
T = TypeVar("T")

PROMPTS, GROUPS, GROUP = "d:prompts", "d:groups", "rollout"
CLAIM_IDLE_MS = 600_000
DRAIN_S = 3.0
EXIT_MARGIN_S = 30.0  # hand-back, engine and server shutdown, on shared busy cores
JOBS = 3
ENGINE = {"preset": "custom", "decode_base_ms": 20, "decode_per_seq_us": 0, "decode_per_kv_token_ns": 0,
          "prefill_per_token_us": 0, "reasoning_tokens_mean": 120, "tool_calls_mean": 2,
          "max_tool_calls": 3, "code_cost": 50, "error_rate": 0.0}


def wait_for(what: str, fn: Callable[[], T | None], timeout_s: float, interval_s: float = 0.05) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    from tests.helpers.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server.url
    finally:
        server.stop()


def _replica(tmp_path_factory: pytest.TempPathFactory, sandbox_url: str, redis_url: str, i: int,
             drain_s: float) -> ServiceProcess:
    from tests.helpers.tiny_model import tiny_model_dir

    model = tiny_model_dir(tmp_path_factory)
    return ServiceProcess(
        ["rollout", "serve", "--model", str(model), "--set", "engine=synthetic", "--sandbox-url", sandbox_url,
         "--redis-url", redis_url, "--set", f"redis.prompts_stream={PROMPTS}",
         "--set", f"redis.groups_stream={GROUPS}", "--set", f"redis.consumer=replica-{i}",
         "--set", "redis.concurrency=4", "--set", f"redis.claim_idle_ms={CLAIM_IDLE_MS}",
         "--set", f"redis.drain_s={drain_s}",
         *[x for k, v in ENGINE.items() for x in ("--set", f"engine_kwargs.{k}={v}")]],
        env={"OMP_NUM_THREADS": "1"}, log_path=tmp_path_factory.mktemp("drain") / f"replica-{i}.log",
        startup_timeout_s=240)


@pytest.fixture
def replicas(tmp_path_factory, sandbox_url, redis_url) -> Iterator[list[ServiceProcess]]:
    procs = [_replica(tmp_path_factory, sandbox_url, redis_url, i, DRAIN_S) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:  # both start at once (model-free, but torch imports)
        started = [pool.submit(p.start) for p in procs]
        try:
            for f in started:
                f.result()
        except BaseException:
            for p in procs:
                p.stop()
            raise
    try:
        yield procs
    finally:
        for p in procs:
            p.stop(grace_s=DRAIN_S + EXIT_MARGIN_S)


def _jobs(n: int = JOBS) -> list[PromptJob]:
    return [PromptJob(messages=[ChatMessage(role="user", content=f"Problem #{k}: compute it.")], n=2,
                      sampling={"max_tokens": 4000}, policy_version=0) for k in range(n)]


def _add(r: redis.Redis, jobs: list[PromptJob]) -> None:
    with r.pipeline(transaction=True) as pipe:  # one write: the replicas' blocked reads split them
        for j in jobs:
            pipe.xadd(PROMPTS, {b"d": j.to_msgpack()})
        pipe.execute()


def _draining(p: ServiceProcess) -> dict | None:
    h = httpx.get(p.url + "/healthz", timeout=5)
    return h.json() if h.status_code == 503 and h.json().get("status") == "draining" else None


@pytest.mark.timeout(600)
def test_sigterm_drains_and_the_other_replica_takes_the_jobs_at_once(replicas, redis_url) -> None:
    r = redis.Redis.from_url(redis_url)
    jobs = _jobs()
    _add(r, jobs)
    held = wait_for("jobs running", lambda: [p for p in replicas
                                             if metric(p.url, "rollout_worker_jobs_in_flight") > 0], 120)
    drained = held[0]
    taker = next(p for p in replicas if p is not drained)
    assert drained.proc is not None
    t0 = time.monotonic()
    drained.proc.send_signal(signal.SIGTERM)

    # during the drain: /healthz says draining (503), /metrics answers, /v1/rollouts is refused
    health = wait_for("/healthz draining", lambda: _draining(drained), DRAIN_S + EXIT_MARGIN_S,
                      interval_s=0.02)
    assert health["draining"] is True
    assert metric(drained.url, "rollout_draining") == 1.0
    refused = httpx.post(drained.url + "/v1/rollouts", json={"prompt_ids": [1, 2], "n": 1}, timeout=10)
    assert refused.status_code == 503 and "draining" in refused.text

    rc = drained.proc.wait(DRAIN_S + EXIT_MARGIN_S)
    exited_s = time.monotonic() - t0
    assert rc == 0, drained.log_path.read_text()[-3000:] if drained.log_path else rc
    log = [json.loads(x) for x in drained.log_path.read_text().splitlines() if x.startswith("{")]
    handed = sum(x.get("jobs", 0) for x in log if x.get("msg") == "jobs handed back")
    assert handed >= 1, "the drained replica held jobs at the signal and must have handed them back"

    def groups() -> list[str]:
        return [Group.from_msgpack(f[b"d"]).job_id for _, f in r.xrange(GROUPS)]
    # far below claim_idle_ms (600 s): only a hand-back gets the jobs done in time
    wait_for("every job's group", lambda: len(groups()) >= JOBS, 240, interval_s=0.2)
    assert sorted(groups()) == sorted(j.job_id for j in jobs)  # each exactly once
    assert metric(taker.url, 'rollout_worker_jobs{outcome="taken_over"}') == handed
    assert metric(taker.url, 'rollout_worker_jobs{outcome="reclaimed"}') == 0
    picked = metric(taker.url, "rollout_handback_pickup_seconds_count")
    wait_sum = metric(taker.url, "rollout_handback_pickup_seconds_sum")
    assert picked == handed
    assert r.xpending(PROMPTS, GROUP)["pending"] == 0  # nothing lost, nothing left to re-claim
    consumers = {c["name"].decode() for c in r.xinfo_consumers(PROMPTS, GROUP)}
    assert "replica-0" not in consumers or "replica-1" not in consumers  # the drained one left
    assert HANDED_BACK in consumers
    # the other replica, holding nothing now, exits 0 too (nothing to hand back)
    assert taker.proc is not None
    taker.proc.send_signal(signal.SIGTERM)
    assert taker.proc.wait(EXIT_MARGIN_S) == 0
    print(f"\ndrain: exit {exited_s:.1f} s after SIGTERM (drain_s {DRAIN_S}); {handed:.0f} jobs handed "
          f"back; mean pick-up wait {wait_sum / picked:.3f} s")



@pytest.mark.timeout(600)
def test_a_second_sigterm_cuts_the_drain_short_and_still_hands_the_job_back(
        tmp_path_factory, sandbox_url, redis_url) -> None:
    r = redis.Redis.from_url(redis_url)
    with _replica(tmp_path_factory, sandbox_url, redis_url, 0, drain_s=600) as p:  # a drain of 10 min
        assert p.proc is not None
        _add(r, _jobs(1))
        wait_for("the job running", lambda: metric(p.url, "rollout_worker_jobs_in_flight") > 0, 120)
        p.proc.send_signal(signal.SIGTERM)
        wait_for("/healthz draining", lambda: _draining(p), EXIT_MARGIN_S, interval_s=0.02)
        p.proc.send_signal(signal.SIGTERM)  # the second: stop now
        rc = p.proc.wait(EXIT_MARGIN_S)  # far below drain_s
        assert rc == -signal.SIGTERM, rc  # uvicorn ends a cut-short process by the signal itself
        held = r.xpending_range(PROMPTS, GROUP, min="-", max="+", count=10, consumername=HANDED_BACK)
        assert len(held) == 1 and held[0]["times_delivered"] == 0  # handed back; the drain not counted
