"""Weight push over a real gRPC server on loopback into a real (tiny) transformers engine.

The engine and the gRPC server live in the test process (so the test can look at the engine's
parameters); the last test runs the replica as a separate process.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from services.common.metrics import MetricsRegistry
from services.proto_gen import retool_pb2 as pb
from services.proto_gen import retool_pb2_grpc as pb_grpc
from services.rollout.engine.base import SamplingParams
from services.rollout.engine.hf import HFEngine
from services.rollout.weights.server import start_weight_server
from services.transport.weights.auth import TOKEN_METADATA_KEY
from services.transport.weights.bucketing import iter_chunks
from services.transport.weights.client import (
    STALLED,
    WeightPushError,
    get_version,
    iter_checkpoint,
    push_checkpoint_async,
    push_state_dict_async,
    stall_limit,
)
from tests.helpers.tiny_model import tiny_model_dir
from tests.helpers.weight_replica import greedy, greedy_of, hf_replica, same, snapshot

pytestmark = pytest.mark.integration
TOKEN = "push-token-5d1e"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, seed=0), tiny_model_dir(tmp_path_factory, seed=1)


@pytest.fixture
async def replica(dirs) -> AsyncIterator[tuple[HFEngine, str, MetricsRegistry]]:
    registry = MetricsRegistry("test")
    async with hf_replica(dirs[0], TOKEN, registry) as (engine, target):
        yield engine, target, registry


async def test_push_changes_greedy_output_and_bumps_version(replica, dirs):
    engine, target, registry = replica
    before = await greedy(engine)
    expected = await greedy_of(dirs[1])
    assert expected != before  # the two seeds really differ
    report = await push_checkpoint_async(dirs[1], [target], TOKEN, version=None, bucket_bytes=64 << 10)
    assert report.version == 1 and engine.version == 1 and await get_version(target) == 1
    assert await greedy(engine) == expected
    assert report.bytes == sum(t.numel() * t.element_size() for _, t in iter_checkpoint(dirs[1]))
    assert report.replies[target]["version"] == 1
    text = registry.render().decode()
    assert 'test_weight_pushes_total{outcome="ok"} 1.0' in text


@pytest.mark.parametrize("token", ["wrong-token", None])
async def test_missing_or_wrong_token_is_rejected_and_changes_nothing(replica, dirs, token):
    engine, target, registry = replica
    before = snapshot(engine)
    chunks = list(iter_chunks(iter_checkpoint(dirs[1]), version=5))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PushWeights(iter(chunks), metadata=metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN not in (err.value.details() or "")
    with pytest.raises(WeightPushError, match="UNAUTHENTICATED"):
        await push_checkpoint_async(dirs[1], [target], "nope", version=5)
    assert engine.version == 0 and same(before, snapshot(engine))
    assert 'test_weight_pushes_total{outcome="unauthenticated"} 2.0' in registry.render().decode()


async def test_interrupted_push_changes_nothing_then_a_full_push_works(replica, dirs):
    engine, target, _ = replica
    before = snapshot(engine)
    chunks = list(iter_chunks(iter_checkpoint(dirs[1]), version=3, bucket_bytes=16 << 10))
    assert len(chunks) > 10
    sent = asyncio.Event()

    async def half() -> AsyncIterator[pb.WeightChunk]:
        for c in chunks[: len(chunks) // 2]:
            yield c
        sent.set()
        await asyncio.sleep(3600)  # the trainer hangs / dies mid-push

    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.WeightServiceStub(channel).PushWeights(half(), metadata=((TOKEN_METADATA_KEY, TOKEN),))
        await asyncio.wait_for(sent.wait(), 30)
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # a stream that simply ends early (no message marked last) is refused
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.WeightServiceStub(channel).PushWeights(
                iter(chunks[:-1]), metadata=((TOKEN_METADATA_KEY, TOKEN),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "incomplete" in err.value.details()
    await asyncio.sleep(0.2)
    assert engine.version == 0 and same(before, snapshot(engine))
    report = await push_state_dict_async(iter_checkpoint(dirs[1]), [target], 3, TOKEN)
    assert report.version == 3 and engine.version == 3
    assert not same(before, snapshot(engine))


def _ptrs(engine: HFEngine) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in engine.model.named_parameters()}


async def _interrupt_before_last(target: str, state: dict[str, torch.Tensor], version: int) -> None:
    """Send every message of a push but the one marked last, then cancel (a trainer dying mid-push)."""
    chunks = list(iter_chunks(state.items(), version=version, bucket_bytes=16 << 10))
    sent = asyncio.Event()

    async def all_but_last() -> AsyncIterator[pb.WeightChunk]:
        for c in chunks[:-1]:
            yield c
        sent.set()
        await asyncio.sleep(3600)

    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.WeightServiceStub(channel).PushWeights(
            all_but_last(), metadata=((TOKEN_METADATA_KEY, TOKEN),))
        await asyncio.wait_for(sent.wait(), 30)
        await asyncio.sleep(0.3)  # the server stages what was sent (into its pool buffers)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    await asyncio.sleep(0.2)


async def test_adopted_buffers_are_never_staged_into_after_repeated_pushes(replica, dirs):
    """The engine serves the staged buffers themselves (no copy) and the pool takes back the ones they
    replaced (double buffering): an interrupted push after adopted pushes leaves the served weights
    exactly those of the last complete push."""
    engine, target, _ = replica
    a, b = dict(iter_checkpoint(dirs[0])), dict(iter_checkpoint(dirs[1]))
    expected_b = await greedy_of(dirs[1])
    initial = _ptrs(engine)
    ptrs = []
    for version, state in ((1, b), (2, a), (3, b)):
        await push_state_dict_async(state.items(), [target], version, TOKEN, bucket_bytes=16 << 10)
        live = engine.model.state_dict()
        assert engine.version == version and all(torch.equal(live[k], state[k]) for k in state)
        ptrs.append(_ptrs(engine))
    # adopted, not copied: every parameter moved off its original storage ...
    assert all(ptrs[0][n] != initial[n] for n in initial)
    # ... and the pool alternates between two sets of buffers
    assert all(ptrs[1][n] != ptrs[0][n] for n in initial) and ptrs[2] == ptrs[0]
    before = snapshot(engine)
    await _interrupt_before_last(target, a, version=9)  # stages a (!= b) into the pool buffers
    assert engine.version == 3 and same(before, snapshot(engine)) and _ptrs(engine) == ptrs[2]
    assert await greedy(engine) == expected_b
    # the next complete push works and is adopted from the other buffer set
    await push_state_dict_async(a.items(), [target], 10, TOKEN, bucket_bytes=16 << 10)
    assert engine.version == 10 and _ptrs(engine) == ptrs[1]
    live = engine.model.state_dict()
    assert all(torch.equal(live[k], a[k]) for k in a)


async def test_tied_alias_and_other_dtypes_are_copied_not_adopted(dirs):
    """Only a parameter's first name in a push is adopted (its tied alias is copied into it); a tensor
    of another dtype is cast and copied into the existing storage; a refused push changes nothing."""
    engine = HFEngine(dirs[0])
    try:
        assert engine.model.config.tie_word_embeddings
        emb, head = "model.embed_tokens.weight", "lm_head.weight"
        embedding = engine.model.get_input_embeddings().weight
        assert embedding is engine.model.get_output_embeddings().weight  # one Parameter, two names
        state = {n: t.clone() for n, t in iter_checkpoint(dirs[1])}
        state[head] = state[emb].clone()
        initial = _ptrs(engine)
        with pytest.raises(KeyError, match="nope"):
            await engine.adopt_weights([*state.items(), ("nope", torch.zeros(1))], 5)
        assert engine.version == 0 and _ptrs(engine) == initial
        replaced = await engine.adopt_weights(state.items(), 1)
        assert head not in replaced and emb in replaced and engine.version == 1
        assert embedding.data_ptr() == state[emb].data_ptr() and torch.equal(embedding, state[head])
        assert set(replaced) == set(state) - {head}
        params = dict(engine.model.named_parameters())
        assert all(params[n].data_ptr() == state[n].data_ptr() for n in params)
        before = _ptrs(engine)
        doubles = {n: (t * 0.5).double() for n, t in state.items() if n != head}
        assert await engine.adopt_weights(doubles.items(), 2) == {}
        assert _ptrs(engine) == before and engine.version == 2
        live = engine.model.state_dict()
        assert all(torch.equal(live[n], t.float()) for n, t in doubles.items())
    finally:
        await engine.shutdown()


class _SlowAfterLoad:
    """An HFEngine whose ``adopt_weights`` returns only after a pause *after* the weights changed, so a
    client can cancel the push between the swap and the server's bookkeeping."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.loaded = asyncio.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def adopt_weights(self, named_tensors, version):
        replaced = await self.inner.adopt_weights(named_tensors, version)
        self.loaded.set()
        await asyncio.sleep(0.5)
        return replaced


async def test_push_cancelled_while_loading_is_loaded_and_hands_its_buffers_over(dirs):
    engine = HFEngine(dirs[0])
    slow = _SlowAfterLoad(engine)
    registry = MetricsRegistry("test")
    server = await start_weight_server(slow, "127.0.0.1", 0, TOKEN, registry=registry)  # type: ignore[arg-type]
    target = f"127.0.0.1:{server.port}"
    a, b = dict(iter_checkpoint(dirs[0])), dict(iter_checkpoint(dirs[1]))
    try:
        await push_state_dict_async(b.items(), [target], 1, TOKEN, bucket_bytes=16 << 10)
        slow.loaded.clear()
        push = asyncio.create_task(
            push_state_dict_async(a.items(), [target], 2, TOKEN, bucket_bytes=16 << 10))
        await asyncio.wait_for(slow.loaded.wait(), 30)
        push.cancel()  # the client goes away while the server finishes the load
        with pytest.raises(asyncio.CancelledError):
            await push
        await asyncio.sleep(1.0)
        live = engine.model.state_dict()
        assert engine.version == 2 and all(torch.equal(live[k], a[k]) for k in a)  # loaded whole
        assert 'test_weight_pushes_total{outcome="ok"} 2.0' in registry.render().decode()  # it counts
        before, ptrs = snapshot(engine), _ptrs(engine)
        await _interrupt_before_last(target, b, version=3)
        assert engine.version == 2 and same(before, snapshot(engine)) and _ptrs(engine) == ptrs
        assert 'test_weight_pushes_total{outcome="ok"} 2.0' in registry.render().decode()  # not applied
    finally:
        await server.stop(None)
        await engine.shutdown()


async def test_partial_or_mismatched_push_is_refused(replica):
    engine, target, _ = replica
    before = snapshot(engine)
    params = dict(engine.model.named_parameters())
    partial = [(n, p.detach() + 1) for n, p in list(params.items())[:3]]
    with pytest.raises(WeightPushError, match="missing"):
        await push_state_dict_async(partial, [target], 2, TOKEN)
    wrong = [(n, p.detach()) for n, p in params.items()]
    wrong[1] = (wrong[1][0], torch.zeros(7, 7))
    with pytest.raises(WeightPushError, match=wrong[1][0]):
        await push_state_dict_async(wrong, [target], 2, TOKEN)
    extra = [*((n, p.detach()) for n, p in params.items()), ("model.not_a_weight", torch.zeros(2))]
    with pytest.raises(WeightPushError, match="not_a_weight"):
        await push_state_dict_async(extra, [target], 2, TOKEN)
    assert engine.version == 0 and same(before, snapshot(engine))


async def test_push_to_two_replicas_and_generation_continues_across_the_swap(dirs):
    engines = [HFEngine(dirs[0]), HFEngine(dirs[0])]
    servers = [await start_weight_server(e, "127.0.0.1", 0, TOKEN) for e in engines]
    targets = [f"127.0.0.1:{s.port}" for s in servers]
    try:
        prompt = engines[0].tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        first = asyncio.Event()
        versions: list[int] = []

        async def consume() -> None:
            params = SamplingParams(temperature=1.0, max_tokens=3000, seed=1)
            async for chunk in engines[0].generate(prompt, params, "long"):
                versions.extend(chunk.versions)
                first.set()

        gen = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 30)
        new = {n: p.detach() * 0.5 for n, p in engines[0].model.named_parameters()}
        report = await push_state_dict_async(new.items(), targets, 4, TOKEN)
        assert set(report.replies) == set(targets) and report.gbps > 0
        assert [e.version for e in engines] == [4, 4]
        await gen
        assert versions[0] == 0 and versions[-1] == 4 and versions == sorted(versions)
    finally:
        for s in servers:
            await s.stop(None)
        for e in engines:
            await e.shutdown()


async def test_a_frozen_replica_is_dropped_from_the_fan_out_and_the_others_take_the_push(replica, dirs):
    """A replica that stops reading (``docker pause``: the kernel still completes the TCP handshake,
    nothing answers) must not hold the push to the others until the deadline: it is dropped as
    STALLED and the healthy replica takes the version (the chaos test's kill fault found this)."""
    engine, target, _ = replica
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)  # never accepted, never read: a paused process
    try:
        dead = f"127.0.0.1:{frozen.getsockname()[1]}"
        with pytest.raises(WeightPushError) as info:
            await push_checkpoint_async(dirs[1], [target, dead], TOKEN, version=3, bucket_bytes=64 << 10,
                                        timeout_s=30)
    finally:
        frozen.close()
    results = info.value.results
    assert results[target] == "ok", results  # before the fix: DEADLINE_EXCEEDED on both
    assert results[dead].startswith(f"{STALLED}: took no bucket for 10 s while 1 other"), results
    assert engine.version == 3 and await greedy(engine) == await greedy_of(dirs[1])


async def test_when_no_target_moves_none_is_dropped_as_stalled():
    """Two frozen targets: neither took a bucket while the other did, so neither is the straggler
    (a slow machine looks the same); the push ends by its deadline, not by the stall rule."""
    frozen = [socket.socket(), socket.socket()]
    try:
        for f in frozen:
            f.bind(("127.0.0.1", 0))
            f.listen(8)
        targets = [f"127.0.0.1:{f.getsockname()[1]}" for f in frozen]
        named = [("w", torch.zeros(1 << 20))]  # 4 MB: 64 buckets of 64 KB, far more than the queues
        with pytest.raises(WeightPushError) as info:
            await push_state_dict_async(named, targets, 1, TOKEN, bucket_bytes=64 << 10, timeout_s=6,
                                        stall_s=1.0)
    finally:
        for f in frozen:
            f.close()
    assert not any(r.startswith(STALLED) for r in info.value.results.values()), info.value.results


def test_stall_limit_is_a_third_of_the_deadline_at_most():
    assert stall_limit(None) == 30.0 and stall_limit(300) == 30.0 and stall_limit(9) == 3.0
    assert stall_limit(0.0) == stall_limit(-1.0) == 0.1  # a retry with no deadline left


def test_standalone_replica_process_receives_a_checkpoint(dirs, tmp_path):
    from services.common.process import free_port

    port = free_port()
    env = {**os.environ, "RETOOL_WEIGHT_TOKEN": TOKEN}
    log = open(tmp_path / "replica.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "services.rollout.weights.server", "--model", str(dirs[0]),
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert asyncio.run(get_version(target, timeout_s=1)) == 0
                break
            except grpc.aio.AioRpcError:
                assert proc.poll() is None and time.monotonic() < deadline, "replica did not start"
                time.sleep(0.2)
        report = asyncio.run(push_checkpoint_async(dirs[1], [target], TOKEN, version=None))
        assert report.version == 1 and asyncio.run(get_version(target)) == 1
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
    assert TOKEN not in (tmp_path / "replica.log").read_text()
