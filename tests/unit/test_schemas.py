"""Wire schemas: invariants are enforced, msgpack round-trips (the group codec itself:
test_group_wire.py)."""

from __future__ import annotations

import json
import random

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from services.common.schemas import ChatMessage, Group, PromptJob, Trajectory, version_range


def _traj(index: int = 0, n_gen: int = 50, n_tool: int = 20, version: int = 3, seed: int = 0) -> Trajectory:
    rng = random.Random(seed)
    ids, mask, lps, vers = [], [], [], []
    for i in range(n_gen + n_tool):
        tool = n_gen // 2 <= i < n_gen // 2 + n_tool
        ids.append(rng.randrange(0, 150_000))
        mask.append(0 if tool else 1)
        lps.append(0.0 if tool else -rng.random() * 5)
        vers.append(-1 if tool else version + (i % 2))
    return Trajectory(
        index=index,
        response_ids=ids,
        loss_mask=mask,
        logprobs=lps,
        versions=vers,
        turns=2,
        tool_calls=1,
        finish_reason="eos",
        reward=1.0,
        correct=True,
        extracted="34",
    )


def test_trajectory_rejects_misaligned_arrays() -> None:
    with pytest.raises(ValidationError, match="same length"):
        Trajectory(
            response_ids=[1, 2], loss_mask=[1], logprobs=[-0.1, -0.2], versions=[0, 0], finish_reason="eos"
        )


def test_trajectory_rejects_mask_version_mismatch() -> None:
    with pytest.raises(ValidationError, match="versions == -1"):
        Trajectory(
            response_ids=[1, 2], loss_mask=[1, 0], logprobs=[-0.1, 0.0], versions=[0, 0], finish_reason="eos"
        )
    with pytest.raises(ValidationError, match="logprobs must be 0.0"):
        Trajectory(
            response_ids=[1, 2],
            loss_mask=[1, 0],
            logprobs=[-0.1, -0.5],
            versions=[0, -1],
            finish_reason="eos",
        )
    with pytest.raises(ValidationError, match="0 or 1"):
        Trajectory(response_ids=[1], loss_mask=[2], logprobs=[-0.1], versions=[0], finish_reason="eos")


def test_group_msgpack_round_trip_is_exact_at_float32() -> None:
    trajs = [_traj(i, seed=i) for i in range(4)]
    group = Group(
        job_id="job-1",
        prompt_ids=list(range(100, 130)),
        trajectories=trajs,
        ground_truth="34",
        data_source="math_dapo",
        job_policy_version=3,
        min_version=3,
        max_version=4,
        replica="r0",
        meta={"epoch": 1, "uid": "abc"},
    )
    raw = group.to_msgpack()
    back = Group.from_msgpack(raw)
    assert back.job_id == "job-1" and back.meta == {"epoch": 1, "uid": "abc"}
    assert back.prompt_ids == group.prompt_ids
    for a, b in zip(group.trajectories, back.trajectories, strict=True):
        assert b.response_ids == a.response_ids
        assert b.loss_mask == a.loss_mask
        assert b.versions == a.versions
        assert b.logprobs == np.asarray(a.logprobs, dtype=np.float32).astype(np.float64).tolist()
        assert (b.reward, b.correct, b.extracted, b.finish_reason) == (a.reward, a.correct, "34", "eos")


def test_prompt_job_requires_exactly_one_prompt_form() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        PromptJob(n=2)
    with pytest.raises(ValidationError, match="exactly one"):
        PromptJob(messages=[ChatMessage(role="user", content="x")], prompt_ids=[1])
    with pytest.raises(ValidationError, match="n"):
        PromptJob(prompt_ids=[1], n=0)


def test_prompt_job_round_trip() -> None:
    job = PromptJob(
        messages=[ChatMessage(role="user", content="1+1?")],
        ground_truth="2",
        n=4,
        sampling={"temperature": 0.7, "seed": 5},
        max_turns=3,
        policy_version=7,
    )
    back = PromptJob.from_msgpack(job.to_msgpack())
    assert back == job
    job2 = PromptJob(prompt_ids=[5, 6, 7], n=1)
    assert PromptJob.from_msgpack(job2.to_msgpack()).prompt_ids == [5, 6, 7]


def test_decode_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="msgpack"):
        Group.from_msgpack(b"\xc1garbage")
    with pytest.raises(ValueError, match="schema version"):
        Group.from_msgpack(msgpack.packb({"job_id": "x"}))
    with pytest.raises(ValueError):
        PromptJob.from_msgpack(msgpack.packb(json.loads('{"schema": 1, "n": 1}')))


def test_version_range_ignores_interpreter_tokens() -> None:
    assert version_range([_traj(version=3), _traj(version=5)]) == (3, 6)
    empty = Trajectory(response_ids=[9], loss_mask=[0], logprobs=[0.0], versions=[-1], finish_reason="eos")
    assert version_range([empty]) == (-1, -1)
