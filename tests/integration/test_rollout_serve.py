"""``retool rollout serve`` as a real subprocess on a real (tiny, randomly initialised) model.

Sandbox, reward service and Redis are real too. A random model writes garbage, so these tests
check the service end to end and the trajectory invariants, not the content (the tool path is
covered deterministically with scripted token streams in test_rollout_http/worker.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from services.common.process import ServiceProcess
from services.common.schemas import ChatMessage, Group, PromptJob, Trajectory
from tests.helpers import agent_fixtures

pytestmark = pytest.mark.integration
reward_url = agent_fixtures.reward_url  # a real reward service (session fixture)

SECRET = "weight-token-9d2e41c7-never-log-me"
MESSAGES = [{"role": "user", "content": "Compute 17*2 with code."}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.tiny_model import tiny_model_dir  # `retool model init-tiny`, built once per session

    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.helpers.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def rollout(tiny_model, sandbox_url, reward_url, redis_url, tmp_path_factory) -> Iterator[ServiceProcess]:
    log = tmp_path_factory.mktemp("rollout") / "rollout.log"
    args = [
        "rollout",
        "serve",
        "--model",
        str(tiny_model),
        "--sandbox-url",
        sandbox_url,
        "--reward-url",
        reward_url,
        "--redis-url",
        redis_url,
        "--weight-token-env",
        "TEST_WEIGHT_TOKEN",
        "--set",
        "redis.block_ms=100",
        "--set",
        "redis.consumer=replica-a",
        "--set",
        "redis.prompts_stream=p",
        "--set",
        "redis.groups_stream=g",
    ]
    proc = ServiceProcess(args, env={"TEST_WEIGHT_TOKEN": SECRET}, log_path=log, startup_timeout_s=120)
    with proc:
        yield proc
    assert SECRET not in log.read_text()


def check_trajectory(t: Trajectory | dict[str, Any], tok: Any) -> None:
    t = t if isinstance(t, Trajectory) else Trajectory.model_validate(t)  # validates the invariants
    assert t.response_ids and len(t.response_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
    assert all(lp < 0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)
    assert {v for v, m in zip(t.versions, t.loss_mask, strict=True) if m} == {0}
    assert tok.decode(t.response_ids) == t.response_text
    assert t.finish_reason in {"eos", "answer", "max_turns", "length"}
    assert t.truncated == (t.finish_reason == "length")
    assert t.reward in (-1.0, 1.0) and t.reward_reason


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_rollouts_end_to_end_on_a_real_model(rollout, tiny_model) -> None:
    tok = _tokenizer(tiny_model)
    body = {"messages": MESSAGES, "ground_truth": "34", "n": 3, "sampling": {"max_tokens": 40, "seed": 3}}
    r = httpx.post(rollout.url + "/v1/rollouts", json=body, timeout=120)
    assert r.status_code == 200, r.text
    group = r.json()
    assert len(group["trajectories"]) == 3
    assert tok.decode(group["prompt_ids"]) == tok.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    for t in group["trajectories"]:
        check_trajectory(t, tok)
        assert len(t["response_ids"]) <= 40
    metrics = httpx.get(rollout.url + "/metrics").text
    gen = sum(sum(t["loss_mask"]) for t in group["trajectories"])
    line = next(x for x in metrics.splitlines() if x.startswith("rollout_generated_tokens_total "))
    assert float(line.split()[1]) >= gen
    assert "rollout_weight_version 0.0" in metrics


def test_stream_on_a_real_model(rollout, tiny_model) -> None:
    tok = _tokenizer(tiny_model)
    body = {"messages": MESSAGES, "n": 2, "stream": True, "sampling": {"max_tokens": 24}}
    events: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", rollout.url + "/v1/rollouts", json=body, timeout=120) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
    assert events[-1][0] == "end" and [k for k, _ in events].count("done") == 2
    for done in (d for k, d in events if k == "done"):
        traj = Trajectory.model_validate(done["trajectory"])
        streamed = [
            t for k, d in events if k == "token" and d["index"] == done["index"] for t in d["token_ids"]
        ]
        assert streamed == [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
        assert tok.decode(traj.response_ids) == traj.response_text


def test_redis_job_to_scored_group(rollout, redis_url, tiny_model) -> None:
    tok = _tokenizer(tiny_model)
    client = redis.Redis.from_url(redis_url)
    job = PromptJob(
        messages=[ChatMessage(**m) for m in MESSAGES],
        ground_truth="34",
        n=2,
        sampling={"max_tokens": 32, "seed": 1},
        policy_version=0,
    )
    client.xadd("p", {b"d": job.to_msgpack()})
    deadline = time.monotonic() + 120
    while not client.xlen("g"):
        assert time.monotonic() < deadline, "no group produced"
        time.sleep(0.1)
    ((_, fields),) = client.xrange("g")
    group = Group.from_msgpack(fields[b"d"])
    assert group.job_id == job.job_id and group.replica == "replica-a" and len(group.trajectories) == 2
    for t in group.trajectories:
        check_trajectory(t, tok)
    # acknowledged (and removed from the prompts stream) once the group was written
    assert client.xpending("p", "rollout")["pending"] == 0 and client.xlen("p") == 0
    client.close()


def test_token_not_on_command_line(rollout) -> None:
    assert rollout.proc is not None
    cmdline = Path(f"/proc/{rollout.proc.pid}/cmdline").read_bytes()
    assert SECRET.encode() not in cmdline and b"TEST_WEIGHT_TOKEN" in cmdline
    assert SECRET not in httpx.get(rollout.url + "/healthz").text


def test_bad_request_is_422_naming_the_field(rollout) -> None:
    r = httpx.post(rollout.url + "/v1/rollouts", json={"messages": MESSAGES, "n": 1000})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "n"]
    r = httpx.post(rollout.url + "/v1/rollouts", json={"messages": MESSAGES, "sampling": {"top_p": 2}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "sampling", "top_p"]
