"""The trainer's GroupReader on the wire contract, against a real Redis: schema 2 and schema 1 groups
are used (as numpy views), broken or unknown-schema groups are dropped as malformed with the
reason logged and their admission slots given back, never a crash."""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest

from services.common.group_wire_v1 import encode_v1
from services.common.packed_group import PackedGroup
from services.common.queue import RedisStream, connect
from services.common.schemas import Group, Trajectory
from services.trainer.feed import GroupReader
from services.trainer.staleness import StalenessManager

pytestmark = pytest.mark.integration


def _group(job_id: str, top_id: int = 900) -> Group:
    trajs = [Trajectory(index=i, response_ids=[7, top_id, 8, 9], loss_mask=[1, 1, 0, 1],
                        logprobs=[-0.25, -1.5, 0.0, -0.125 * i], versions=[3, 3, -1, 4], finish_reason="eos",
                        reward=float(i)) for i in range(2)]
    return Group(job_id=job_id, prompt_ids=[1, 2, 3], trajectories=trajs, min_version=3, max_version=4,
                 job_policy_version=3)


def _with(raw: bytes, edit) -> bytes:  # noqa: ANN001
    data = msgpack.unpackb(raw, raw=False)
    edit(data)
    return msgpack.packb(data, use_bin_type=True)


def _nan_logprob(data: dict) -> None:
    data["tokens"]["logprobs"] = np.array([-0.25, np.nan, 0.0, 0.0, -0.5, -0.125], "<f4").tobytes()


def _schema_3(data: dict) -> None:
    data["schema"] = 3


async def test_reader_uses_both_schemas_and_drops_broken_groups_as_malformed(redis_server, caplog) -> None:
    client = connect(redis_server.url)
    stream = RedisStream(client, "groups", "trainer")
    await stream.ensure_group()
    good, old = _group("a"), _group("b")
    entries = [
        _with(_group("c").to_msgpack(), _nan_logprob),
        _with(_group("d").to_msgpack(), _schema_3),
        _group("e", top_id=5000).to_msgpack(),  # an id outside the 1000-token vocabulary
        b"\xc1 not msgpack",
        good.to_msgpack(),
        encode_v1(old),  # a replica not upgraded yet
    ]
    for raw in entries:
        await stream.add(raw)
    manager = StalenessManager(batch_prompts=2, max_staleness=1, version=3, admitted=12)
    reader = GroupReader(stream, "t0", manager, vocab_size=1000)
    with caplog.at_level(logging.WARNING, logger="trainer.feed"):
        batch = await reader.next_batch(2, block_ms=100, max_wait_rounds=2)
    assert [g.job_id for g in batch.groups] == ["a", "b"]
    for got, sent in zip(batch.groups, (good, old), strict=True):
        assert isinstance(got, PackedGroup) and isinstance(got.trajectories[0].response_ids, np.ndarray)
        assert got.to_group() == sent  # these log-probs are exact in float32
    assert batch.dropped == {"malformed": 4}
    assert batch.drops == [("c", "malformed"), ("d", "malformed"), ("e", "malformed")]
    errors = [getattr(r, "error", "") for r in caplog.records if r.getMessage() == "dropping malformed group"]
    assert "not finite" in errors[0] and "schema version 3 is not supported" in errors[1]
    assert "token id 5000 is outside the vocabulary (vocab_size 1000)" in errors[2]
    assert "not valid msgpack" in errors[3]
    # c, d and e resolved their jobs and gave their slots back; the unreadable entry names no job,
    # so its slot stays held (the job, if it was one, is found vanished and re-issued)
    assert manager.admitted == 9
    assert await reader.commit() == 6 and await stream.pending() == 0
    await client.aclose()
