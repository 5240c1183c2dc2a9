"""Trainer side of the weight push: stream a state dict to every rollout replica at once.

Invariants:
- each bucket is packed once and fanned out to all targets (bounded queues: memory stays at a
  few buckets per target, the slowest replica sets the pace);
- a push to several replicas fails as a whole: if one target fails, the others are cancelled
  mid-stream (their weights stay unchanged — the server applies only complete pushes) and a
  ``WeightPushError`` lists each target's outcome; targets that had already finished keep the
  new weights, so the caller retries the whole push (pushes are idempotent per version);
- a target that stalls (a frozen or partitioned replica: its queue stays full, no bucket taken for
  ``stall_s``) while another target keeps up (took a bucket in that time, or all it was given) is
  dropped from the fan-out with the
  result ``STALLED: ...`` and the others go on at their own pace: one frozen replica must not hold
  every other one until the deadline (found by the chaos test: a ``docker pause``d replica made a
  full push time out on both replicas and the trainer stopped). When no target moved (a slow
  machine), nobody is dropped; a lone target always has the whole deadline;
- the token travels only in the gRPC metadata, never in logs or error messages; with a
  ``ChannelSecurity`` (``tls.py``) every channel is TLS (optionally mutual), never plain text;
- ``kind`` makes it a delta push (``PushKind(delta=True, base_version, lineage)``, tensors are
  ``WireTensor``s from ``delta.DeltaEncoder``) or tags a full push with the pusher's lineage; a
  replica that cannot apply the delta answers FAILED_PRECONDITION (``is_stale_base``);
- ``push_state_dict_shm``: the colocated transport (``shm.py``) for a replica on this machine under
  this uid: RegisterShm (free segment + generation) -> one copy into the free segment -> CommitShm;
  the mapping is cached per target and layout id (a restarted replica gets a new one).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from safetensors import safe_open

from services.proto_gen import retool_pb2 as pb
from services.proto_gen import retool_pb2_grpc as pb_grpc
from services.transport.weights.auth import TOKEN_METADATA_KEY
from services.transport.weights.bucketing import (
    DEFAULT_BUCKET_BYTES,
    GRPC_BULK_OPTIONS,
    PushKind,
    WireTensor,
    iter_buckets,
)
from services.transport.weights.memory import keep_freed_buffers
from services.transport.weights.shm import ShmError, ShmMapping, boot_id
from services.transport.weights.tls import ChannelSecurity, open_channel

CHANNEL_OPTIONS = GRPC_BULK_OPTIONS
QUEUE_DEPTH = 4
STALLED = "STALLED"  # result prefix of a target dropped from a fan-out for taking no bucket in stall_s
DEFAULT_STALL_S = 30.0


def stall_limit(timeout_s: float | None) -> float:
    """How long one target may take no bucket while the others wait: 30 s, or a third of the push's
    deadline when that is shorter (so a stalled target is dropped well before the others time out),
    never under 0.1 s (a retry late in its budget has almost no deadline left)."""
    return DEFAULT_STALL_S if timeout_s is None else max(0.1, min(DEFAULT_STALL_S, timeout_s / 3))
PUSH_METHOD = "/retool.v1.WeightService/PushWeights"


class WeightPushError(RuntimeError):
    def __init__(self, message: str, results: dict[str, str],
                 errors: dict[str, BaseException] | None = None) -> None:
        super().__init__(message)
        self.results = results  # target -> "ok" or what went wrong
        self.errors = errors or {}  # target -> its exception (e.g. for ``is_stale_base``)


@dataclass
class PushReport:
    version: int
    tensors: int
    bytes: int
    seconds: float
    replies: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Payload GB/s per replica (1 GB = 1e9 bytes), end to end (received and loaded)."""
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


async def get_version(target: str, timeout_s: float = 10.0, security: ChannelSecurity | None = None) -> int:
    return int((await get_replica_state(target, timeout_s, security)).version)


async def get_replica_state(target: str, timeout_s: float = 10.0,
                            security: ChannelSecurity | None = None) -> pb.VersionReply:
    """Version, serving dtype and delta lineage of the replica at ``target``."""
    async with open_channel(target, security, CHANNEL_OPTIONS) as channel:
        return await pb_grpc.WeightServiceStub(channel).GetVersion(pb.VersionRequest(), timeout=timeout_s)


def is_stale_base(exc: BaseException) -> bool:
    """A delta refused because the replica does not serve its base (it needs a full push)."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION


async def _push_one(target: str, queue: asyncio.Queue[bytes | None], token: str,
                    timeout_s: float | None, security: ChannelSecurity | None,
                    taken: dict[str, float] | None = None) -> pb.PushReply:
    """One target's stream; ``taken[target]`` is the time gRPC last pulled a bucket (its progress)."""
    async def requests() -> AsyncIterator[bytes]:
        while (chunk := await queue.get()) is not None:
            if taken is not None:
                taken[target] = time.monotonic()
            yield chunk

    async with open_channel(target, security, CHANNEL_OPTIONS) as channel:
        # serialized WeightChunk bytes from Bucket.encode (one copy of the tensor bytes)
        call = channel.stream_unary(PUSH_METHOD, request_serializer=None,
                                    response_deserializer=pb.PushReply.FromString)
        return await call(requests(), metadata=((TOKEN_METADATA_KEY, token),), timeout=timeout_s)


async def push_state_dict_async(named_tensors: Iterable[tuple[str, torch.Tensor] | WireTensor],
                                targets: list[str], version: int, token: str,
                                bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float | None = None,
                                kind: PushKind = PushKind(),
                                security: ChannelSecurity | None = None,
                                stall_s: float | None = None) -> PushReport:
    """Push ``named_tensors`` to every ``host:port`` in ``targets``; all are complete on return.
    ``stall_s`` (default ``stall_limit(timeout_s)``): see the module's invariants."""
    if not targets:
        raise ValueError("targets: at least one host:port is required")
    if version < 0:
        raise ValueError("version: must be >= 0")
    if stall_s is not None and stall_s <= 0:
        raise ValueError(f"stall_s: must be > 0 (or None), got {stall_s}")
    keep_freed_buffers()
    queues: dict[str, asyncio.Queue[bytes | None]] = {t: asyncio.Queue(QUEUE_DEPTH) for t in targets}
    stats = {"tensors": 0, "bytes": 0}
    stall = stall_s if stall_s is not None else stall_limit(timeout_s)
    stalled: dict[str, str] = {}  # target -> why it was dropped from the fan-out
    taken = dict.fromkeys(targets, time.monotonic())  # target -> when it last took a bucket
    start = time.perf_counter()

    async def put(target: str, message: bytes | None) -> None:
        """Queue ``message`` for ``target``. A target that takes nothing for ``stall`` while another
        one keeps up (took a bucket in that time, or everything queued for it) is the straggler:
        dropped. When none moved (a slow machine or
        network, not one frozen replica) the fan-out keeps waiting: only the deadline ends it."""
        queue = queues[target]
        if len(targets) == 1:
            await queue.put(message)
            return
        # not once its stream ended (failed or cancelled): nobody takes from its queue any more
        while target not in stalled and not tasks[target].done():
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow the cancellation that
                # ends a failed push, which would leave the producer looping here forever
                async with asyncio.timeout(stall):
                    await queue.put(message)
                return
            except TimeoutError:
                now = time.monotonic()
                # another target keeps up: it took a bucket lately, or took all it was given
                moving = [t for t in targets if t != target and t not in stalled
                          and (now - taken[t] < stall or queues[t].empty())]
                if moving:
                    stalled[target] = (f"{STALLED}: took no bucket for {stall:g} s while {len(moving)} other "
                                       "target(s) did; dropped from this push")
                    tasks[target].cancel()

    async def produce() -> None:
        for bucket in iter_buckets(named_tensors, version, bucket_bytes, kind):
            if bucket.header.last:
                stats["tensors"], stats["bytes"] = bucket.header.total_tensors, bucket.header.total_bytes
            message = bucket.encode()
            for t in targets:
                await put(t, message)
        for t in targets:
            await put(t, None)

    producer = asyncio.create_task(produce())
    tasks = {t: asyncio.create_task(_push_one(t, queues[t], token, timeout_s, security, taken))
             for t in targets}
    results: dict[str, str] = {}
    try:
        pending: set[asyncio.Task] = {producer, *tasks.values()}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() is not None for t in done if not t.cancelled()):
                break
    finally:
        for t in (producer, *tasks.values()):
            if not t.done():
                t.cancel()
        await asyncio.gather(producer, *tasks.values(), return_exceptions=True)
    seconds = time.perf_counter() - start
    replies: dict[str, dict[str, float]] = {}
    errors: dict[str, BaseException] = {}
    for target, task in tasks.items():
        if target in stalled:
            results[target] = stalled[target]
            errors[target] = TimeoutError(stalled[target])
        elif task.cancelled():
            results[target] = "cancelled (another target failed)"
        elif (exc := task.exception()) is not None:
            results[target] = _describe(exc)
            errors[target] = exc
        else:
            reply = task.result()
            results[target] = "ok"
            replies[target] = {"version": reply.version, "receive_seconds": reply.receive_seconds,
                               "load_seconds": reply.load_seconds, "changed": reply.changed}
    if not producer.cancelled() and (exc := producer.exception()) is not None:
        raise exc
    if any(r != "ok" for r in results.values()):
        raise WeightPushError(f"weight push of version {version} failed: {json.dumps(results)}", results,
                              errors)
    return PushReport(version, stats["tensors"], stats["bytes"], seconds, replies)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


_SHM_MAPPINGS: dict[str, ShmMapping] = {}  # target -> mapping of its current segments


def _shm_mapping(target: str, layout: pb.ShmLayout) -> ShmMapping:
    mapping = _SHM_MAPPINGS.get(target)
    if mapping is None or mapping.layout_id != layout.layout_id:
        if mapping is not None:  # the replica restarted: its old segments are gone
            mapping.close()
            del _SHM_MAPPINGS[target]
        mapping = ShmMapping(layout)
        _SHM_MAPPINGS[target] = mapping
    return mapping


def close_shm_mappings() -> None:
    """Unmap every cached replica segment (they are unmapped at exit anyway)."""
    for mapping in _SHM_MAPPINGS.values():
        mapping.close()
    _SHM_MAPPINGS.clear()


async def push_state_dict_shm_async(named_tensors: Iterable[tuple[str, torch.Tensor]], target: str,
                                    version: int, token: str, timeout_s: float | None = None,
                                    security: ChannelSecurity | None = None) -> PushReport:
    """Push ``named_tensors`` to the replica at ``target`` through its shared-memory segments.

    Only for a replica on this machine, under this uid, seeing the same ``/dev/shm``; anything else
    fails with a ``WeightPushError`` before the commit (the weights stay unchanged).
    """
    if version < 0:
        raise ValueError("version: must be >= 0")
    metadata = ((TOKEN_METADATA_KEY, token),)
    start = time.perf_counter()
    try:
        async with open_channel(target, security) as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            layout = await stub.RegisterShm(pb.ShmRequest(boot_id=boot_id()), metadata=metadata,
                                            timeout=timeout_s)
            mapping = _shm_mapping(target, layout)
            tensors, nbytes = await asyncio.to_thread(mapping.write, layout.free_segment, named_tensors)
            reply = await stub.CommitShm(
                pb.ShmCommit(version=version, segment=layout.free_segment, generation=layout.generation),
                metadata=metadata, timeout=timeout_s)
    except (grpc.aio.AioRpcError, ShmError, OSError) as exc:
        results = {target: _describe(exc)}
        raise WeightPushError(f"shared-memory weight push of version {version} failed: "
                              f"{json.dumps(results)}", results) from exc
    seconds = time.perf_counter() - start
    return PushReport(version, tensors, nbytes, seconds,
                      {target: {"version": reply.version, "receive_seconds": reply.receive_seconds,
                                "load_seconds": reply.load_seconds}})


def push_state_dict_shm(named_tensors: Iterable[tuple[str, torch.Tensor]], target: str, version: int,
                        token: str, timeout_s: float | None = None) -> PushReport:
    """Synchronous ``push_state_dict_shm_async``."""
    return asyncio.run(push_state_dict_shm_async(named_tensors, target, version, token, timeout_s))


def iter_checkpoint(checkpoint_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of a Hugging Face checkpoint directory (``*.safetensors``, sharded or not), lazily."""
    root = Path(checkpoint_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint: no *.safetensors files in {root}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


async def push_checkpoint_async(checkpoint_dir: str | Path, targets: list[str], token: str,
                                version: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                                timeout_s: float | None = None,
                                security: ChannelSecurity | None = None) -> PushReport:
    """Push a checkpoint's weights; ``version=None`` means one above the highest version served."""
    if version is None:
        version = max(await asyncio.gather(*(get_version(t, security=security) for t in targets))) + 1
    return await push_state_dict_async(iter_checkpoint(checkpoint_dir), targets, version, token,
                                       bucket_bytes, timeout_s, security=security)


def push_checkpoint(checkpoint_dir: str | Path, targets: list[str], token: str, version: int | None = None,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float | None = None,
                    security: ChannelSecurity | None = None) -> PushReport:
    """Synchronous ``push_checkpoint_async``."""
    return asyncio.run(
        push_checkpoint_async(checkpoint_dir, targets, token, version, bucket_bytes, timeout_s, security))
