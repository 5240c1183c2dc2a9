"""Colocated weight push through shared memory into a real gRPC server and a real (tiny) HF engine.

The engine and the weight server live in the test process (the test looks at the engine's
parameters and at the segment files); the client maps the same /dev/shm files a trainer would.
"""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from services.proto_gen import retool_pb2 as pb
from services.proto_gen import retool_pb2_grpc as pb_grpc
from services.rollout.engine.hf import HFEngine
from services.rollout.weights.server import start_weight_server
from services.transport.weights.auth import TOKEN_METADATA_KEY
from services.transport.weights.client import (
    WeightPushError,
    close_shm_mappings,
    get_version,
    iter_checkpoint,
    push_state_dict_async,
    push_state_dict_shm_async,
)
from services.transport.weights.shm import PREFIX, ShmMapping
from tests.helpers.tiny_model import tiny_model_dir
from tests.helpers.weight_replica import greedy, greedy_of, hf_replica, same, snapshot

pytestmark = pytest.mark.integration
TOKEN = "shm-token-7c2a"
AUTH = ((TOKEN_METADATA_KEY, TOKEN),)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, seed=0), tiny_model_dir(tmp_path_factory, seed=1)


@pytest.fixture(scope="module")
def states(dirs) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return dict(iter_checkpoint(dirs[0])), dict(iter_checkpoint(dirs[1]))


@pytest.fixture
async def replica(dirs) -> AsyncIterator[tuple[HFEngine, str]]:
    async with hf_replica(dirs[0], TOKEN) as replica:
        yield replica


def _serves(engine: HFEngine, state: dict[str, torch.Tensor]) -> bool:
    """Every weight of ``state`` (a checkpoint: tied aliases dropped) equals the engine's, exactly."""
    served = engine.model.state_dict()
    return all(torch.equal(served[k], v) for k, v in state.items())


async def _register(target: str, metadata=AUTH) -> pb.ShmLayout:
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.WeightServiceStub(channel).RegisterShm(pb.ShmRequest(), metadata=metadata)


async def _commit(target: str, commit: pb.ShmCommit, metadata=AUTH) -> pb.PushReply:
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.WeightServiceStub(channel).CommitShm(commit, metadata=metadata)


def _segment_of(engine: HFEngine, layout: pb.ShmLayout) -> set[int]:
    """Which segment files the engine's weights live in, from the kernel's list of this process's
    mappings (/proc/self/maps), not from the server's own bookkeeping."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() in layout.paths:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi, list(layout.paths).index(fields[5].strip())))
    return {i for p in engine.model.parameters() for lo, hi, i in ranges if lo <= p.data_ptr() < hi}


async def test_shm_push_changes_greedy_output_and_bumps_version(replica, dirs, states):
    engine, target = replica
    before = await greedy(engine)
    expected = await greedy_of(dirs[1])
    assert expected != before  # the two seeds really differ
    report = await push_state_dict_shm_async(states[1].items(), target, version=1, token=TOKEN)
    assert report.version == 1 and engine.version == 1 and await get_version(target) == 1
    assert report.replies[target]["version"] == 1
    assert await greedy(engine) == expected
    assert _serves(engine, states[1])
    # tied weights are stored once: the layout holds fewer bytes than the engine's state dict names
    assert report.bytes == sum(t.numel() * t.element_size() for t in states[1].values())
    layout = await _register(target)
    assert len(layout.paths) == 2
    for path in layout.paths:
        st = os.stat(path)
        assert Path(path).name.startswith(PREFIX) and Path(path).parent == Path("/dev/shm")
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert st.st_size == layout.segment_bytes
    assert all(t.offset % 4096 == 0 for t in layout.tensors)


async def test_consecutive_pushes_alternate_segments_and_serve_the_last_exactly(replica, states):
    engine, target = replica
    first = await _register(target)
    assert first.free_segment == 0 and _segment_of(engine, first) == set()
    await push_state_dict_shm_async(states[1].items(), target, version=1, token=TOKEN)
    second = await _register(target)
    assert second.free_segment == 1 and second.generation == first.generation + 1
    assert second.layout_id == first.layout_id
    assert _segment_of(engine, second) == {0} and _serves(engine, states[1])
    await push_state_dict_shm_async(states[0].items(), target, version=2, token=TOKEN)
    third = await _register(target)
    assert third.free_segment == 0 and _segment_of(engine, third) == {1}
    assert engine.version == 2 and _serves(engine, states[0]) and not _serves(engine, states[1])
    await push_state_dict_shm_async(states[1].items(), target, version=3, token=TOKEN)
    assert _segment_of(engine, await _register(target)) == {0} and _serves(engine, states[1])
    # a gRPC push moves the weights out of the segments: both are free again, 0 is reported
    await push_state_dict_async(states[0].items(), [target], version=4, token=TOKEN)
    after_grpc = await _register(target)
    assert after_grpc.free_segment == 0 and _segment_of(engine, after_grpc) == set()
    assert engine.version == 4 and _serves(engine, states[0])


@pytest.mark.parametrize("token", ["wrong-token", None])
async def test_wrong_or_missing_token_is_rejected_and_changes_nothing(replica, states, token):
    engine, target = replica
    before = snapshot(engine)
    metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _register(target, metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    layout = await _register(target)  # a legitimate trainer registered and wrote the free segment
    ShmMapping(layout).write(layout.free_segment, states[1].items())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _commit(target, pb.ShmCommit(version=9, segment=layout.free_segment,
                                           generation=layout.generation), metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN not in (err.value.details() or "")
    with pytest.raises(WeightPushError, match="UNAUTHENTICATED"):
        await push_state_dict_shm_async(states[1].items(), target, version=9, token="nope")
    assert engine.version == 0 and same(before, snapshot(engine))


async def test_commit_of_the_non_free_segment_or_a_stale_generation_is_rejected(replica, states):
    engine, target = replica
    await push_state_dict_shm_async(states[1].items(), target, version=1, token=TOKEN)
    layout = await _register(target)
    assert layout.free_segment == 1
    served = snapshot(engine)
    mapping = ShmMapping(layout)
    try:
        mapping.write(1, states[0].items())
        for commit, code in ((pb.ShmCommit(version=2, segment=0, generation=layout.generation),
                              grpc.StatusCode.FAILED_PRECONDITION),  # the segment being served
                             (pb.ShmCommit(version=2, segment=2, generation=layout.generation),
                              grpc.StatusCode.INVALID_ARGUMENT),
                             (pb.ShmCommit(version=2, segment=1, generation=layout.generation - 1),
                              grpc.StatusCode.FAILED_PRECONDITION)):  # stale
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _commit(target, commit)
            assert err.value.code() == code, commit
        assert engine.version == 1 and same(served, snapshot(engine))
        # another push in between makes the generation of the earlier registration stale
        await push_state_dict_async(states[1].items(), [target], version=5, token=TOKEN)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _commit(target, pb.ShmCommit(version=6, segment=1, generation=layout.generation))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "generation" in (err.value.details() or "")
        assert engine.version == 5 and _serves(engine, states[1])
    finally:
        mapping.close()


async def test_a_write_that_is_never_committed_changes_nothing(replica, states):
    engine, target = replica
    await push_state_dict_shm_async(states[1].items(), target, version=1, token=TOKEN)
    served = snapshot(engine)
    layout = await _register(target)
    mapping = ShmMapping(layout)
    try:  # a trainer that dies halfway through its write: garbage in the free segment, no commit
        for i, view in enumerate(mapping._views[layout.free_segment].values()):
            if i % 2 == 0:
                view.fill_(7.0)
    finally:
        mapping.close()
    assert engine.version == 1 and same(served, snapshot(engine))
    assert await get_version(target) == 1
    # an incomplete state dict is refused on the client, before any commit
    partial = list(states[0].items())[:-1]
    with pytest.raises(WeightPushError, match="missing"):
        await push_state_dict_shm_async(partial, target, version=2, token=TOKEN)
    assert engine.version == 1 and same(served, snapshot(engine))
    # the next complete push overwrites the garbage and is served exactly
    await push_state_dict_shm_async(states[0].items(), target, version=2, token=TOKEN)
    assert engine.version == 2 and _serves(engine, states[0])


async def test_segments_are_unlinked_when_the_server_stops(dirs, states):
    engine = HFEngine(dirs[0])
    server = await start_weight_server(engine, "127.0.0.1", 0, TOKEN)
    target = f"127.0.0.1:{server.port}"
    try:
        # a trainer on another machine (another kernel's boot id) is refused before any allocation
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.WeightServiceStub(channel).RegisterShm(
                    pb.ShmRequest(boot_id="another-machine"), metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "boot_id" in err.value.details()
        assert server.servicer._shm is None
        await push_state_dict_shm_async(states[1].items(), target, version=1, token=TOKEN)
        layout = await _register(target)
        assert all(os.path.exists(p) for p in layout.paths)
    finally:
        close_shm_mappings()
        await server.stop(None)
    try:
        assert not any(os.path.exists(p) for p in layout.paths)
        assert _serves(engine, states[1])  # the served weights outlive the unlinked files
        assert await greedy(engine)
    finally:
        await engine.shutdown()


async def test_trainer_push_over_shm_reaches_every_replica_and_fails_as_a_whole(dirs, states):
    """``services.trainer.push.push_weights(transport="shm")``, as the trainer calls it (``lm.`` names)."""
    from services.trainer.push import push_weights

    engines = [HFEngine(dirs[0]), HFEngine(dirs[0])]
    servers = [await start_weight_server(e, "127.0.0.1", 0, TOKEN) for e in engines]
    targets = [f"127.0.0.1:{s.port}" for s in servers]
    trainer_names = {f"lm.{k}": v for k, v in states[1].items()}
    try:
        out = await push_weights(trainer_names, targets, 3, TOKEN, bucket_bytes=2**20, transport="shm")
        assert out["weights/push_targets"] == 2 and out["weights/push_gbps"] > 0
        assert all(e.version == 3 and _serves(e, states[1]) for e in engines)
        with pytest.raises(WeightPushError, match="UNAUTHENTICATED") as err:
            await push_weights(trainer_names, targets, 4, "bad", bucket_bytes=2**20, transport="shm",
                               attempts=2, backoff_s=0.01)
        assert set(err.value.results) == set(targets)
        assert all(e.version == 3 for e in engines)
    finally:
        close_shm_mappings()
        for server, engine in zip(servers, engines, strict=True):
            await server.stop(None)
            await engine.shutdown()
