"""gRPC weight-push server of a rollout replica (``retool.v1.WeightService``).

Invariants:
- ``PushWeights`` requires the shared-secret token in the ``x-retool-token`` metadata; a missing
  or wrong token is rejected with UNAUTHENTICATED before any byte is staged; the token is never
  logged; with TLS settings the port speaks only TLS (``transport/weights/tls.py``), so the token
  and the weights never cross the network in plain text;
- a push is staged in CPU memory and handed to ``engine.load_weights`` only once it is complete
  (see ``bucketing.Stager``) and, when the engine can tell, covers every weight of the model; an
  interrupted, malformed or incomplete push changes nothing; a push cancelled after its last
  message, while the engine loads it, is loaded completely (never half) before the next starts;
- pushes are received and applied one at a time (a lock): two concurrent pushes never
  interleave, and they can share one set of staging buffers, reused from push to push;
- an engine with ``adopt_weights`` takes the staged buffers as its new weights (no copy); the
  pool then swaps in the engine's old buffers for the next push and never writes adopted ones;
- colocated transport (``RegisterShm``/``CommitShm``, see ``shm.py``): same token, same lock; a
  commit is accepted only for the segment reported free, at the generation it was reported at
  (every weight change bumps the generation), so no served weight is ever in a writable segment;
  the segments are unlinked when the server stops;
- delta pushes (``delta.py``): the replica has a *lineage* (reported by GetVersion) only while the
  weights it serves are exactly those of ``engine.version`` as pushed with that lineage, in the
  pushed dtypes; a delta whose ``base_version``/``lineage`` differ is refused with
  FAILED_PRECONDITION at its first message. An engine with ``patch_weights`` (HF) gets the changed
  elements written into its served tensors under its step lock; any other engine gets the changed
  tensors reconstructed in full through ``load_weights`` from the copy of the served weights this
  server keeps for it (``_served``). Every patch is validated before any weight is touched; any
  refused or failed load clears the lineage (the next push must be full).

Run standalone (a bare replica for the weight benchmark):
``RETOOL_WEIGHT_TOKEN=... python -m services.rollout.weights.server --model DIR --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from services.common.logging import get_logger
from services.common.metrics import MetricsRegistry
from services.common.security import TLSServerFiles
from services.proto_gen import retool_pb2 as pb
from services.rollout.engine.base import Engine
from services.rollout.engine.hf import HFEngine
from services.rollout.engine.weight_spec import validate_push
from services.transport.weights.auth import TOKEN_METADATA_KEY
from services.transport.weights.bucketing import (
    GRPC_BULK_OPTIONS,
    PushError,
    Stager,
    StagingPool,
    decode_chunk,
    dtype_name,
)
from services.transport.weights.delta import SparsePatch, decode_sparse
from services.transport.weights.memory import keep_freed_buffers
from services.transport.weights.shm import SHM_DIR, ShmError, ShmSegments, boot_id
from services.transport.weights.tls import server_credentials

log = get_logger("rollout.weights")

GRPC_OPTIONS = GRPC_BULK_OPTIONS


class WeightPushMetrics:
    """Push-level metrics on a caller's registry (the engine's version/load time are the app's)."""

    def __init__(self, registry: MetricsRegistry) -> None:
        self.pushes = registry.counter("weight_pushes_total", "Weight pushes by outcome", ("outcome",))
        self.bytes = registry.counter("weight_push_bytes_total", "Bytes of weights received and loaded")
        self.receive = registry.histogram(
            "weight_push_receive_seconds", "Seconds from the first to the last message of a push",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
        )
        self.applied = registry.counter("weight_pushes_applied_total", "Pushes applied, by kind", ("kind",))
        self.changed = registry.counter(
            "weight_push_changed_elements_total", "Weight elements changed by delta pushes")
        for kind in ("full", "delta", "shm"):
            self.applied.labels(kind)
        for outcome in ("ok", "invalid", "stale_base", "unauthenticated", "interrupted"):
            self.pushes.labels(outcome)


class WeightServicer:
    """``retool.v1.WeightService``; registered with ``handler()`` so PushWeights decodes zero-copy."""

    def __init__(self, engine: Engine, token: str, metrics: WeightPushMetrics | None = None,
                 max_push_bytes: int | None = None, shm_dir: str | os.PathLike[str] = SHM_DIR) -> None:
        if not token:
            raise ValueError("token: the weight-push server needs a non-empty token")
        self.engine = engine
        self._token = token.encode()
        self.metrics = metrics
        self.max_push_bytes = max_push_bytes
        self._lock = asyncio.Lock()
        self._pool = StagingPool()
        self.shm_dir = shm_dir
        self._shm: ShmSegments | None = None  # created by the first RegisterShm
        self._generation = 0  # bumped on every weight change (any transport)
        self._lineage = ""  # non-empty: deltas on engine.version of this lineage apply
        # engines without patch_weights: the served weights as pushed (the base of a delta)
        self._served: dict[str, torch.Tensor] = {}

    @property
    def lineage(self) -> str:
        return self._lineage

    def serving_dtype(self) -> str:
        dtype = getattr(self.engine, "serving_dtype", None)
        return str(dtype).removeprefix("torch.") if dtype else ""

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._token)
        return False

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.pushes.labels(outcome).inc()

    async def PushWeights(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.PushReply:
        if not self._authorized(context):
            self._count("unauthenticated")
            log.warning("weight push rejected: missing or wrong token", extra={"peer": context.peer()})
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong weight-push token")
        async with self._lock:
            return await self._push(request_iterator, context)

    async def _push(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.PushReply:
        specs = getattr(self.engine, "weight_specs", None)
        stager = Stager(specs() if callable(specs) else None, max_bytes=self.max_push_bytes, pool=self._pool)
        start: float | None = None
        try:
            async for chunk, data in request_iterator:  # decode_chunk: ``data`` is a view, not a copy
                if start is None:
                    start = time.perf_counter()
                    if chunk.delta and (stale := self._stale_base(chunk)):
                        self._count("stale_base")
                        log.info("delta push refused: stale base", extra={"reason": stale})
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, stale)
                stager.add(chunk, data)
            if not stager.complete:
                raise PushError("incomplete push: the stream ended before the message marked last")
            missing_fn = getattr(self.engine, "missing_weights", None)
            missing = missing_fn(stager.names()) if callable(missing_fn) and not stager.delta else []
            if missing:
                raise PushError(f"incomplete push: {len(missing)} weights missing, e.g. {missing[:3]}")
            patches = self._patches(stager) if stager.delta else []
        except PushError as exc:
            self._count("invalid")
            log.warning("weight push rejected", extra={"error": str(exc)})
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except asyncio.CancelledError:
            self._count("interrupted")
            log.warning("weight push interrupted; weights unchanged")
            raise
        received = time.perf_counter()
        version = int(stager.version or 0)
        # The load runs in a worker thread and cannot be stopped once started: it is shielded from
        # a cancelled RPC and awaited before the push lock is released, so the pool has taken back
        # exactly the buffers the engine gave up before the next push stages into it.
        apply = asyncio.ensure_future(self._apply(stager.tensors(), version, patches, stager))
        try:
            await asyncio.shield(apply)
        except asyncio.CancelledError:
            if not apply.done():
                await asyncio.wait([apply])
            if apply.cancelled() or apply.exception() is not None:  # refused: nothing changed
                self._count("invalid")
                raise
            self._loaded(stager, version, received - (start or received), time.perf_counter() - received)
            log.warning("the client went away while its push was loading; the push was applied",
                        extra={"version": version})
            raise
        except (KeyError, ValueError) as exc:  # the engine validates before it touches anything
            self._count("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"load_weights: {exc}")
        receive_s, load_s = received - (start or received), time.perf_counter() - received
        self._loaded(stager, version, receive_s, load_s)
        return pb.PushReply(version=self.engine.version, tensors=len(stager.names()), bytes=stager.bytes,
                            receive_seconds=receive_s, load_seconds=load_s, delta=stager.delta,
                            changed=stager.changed() if stager.delta else 0)

    def _stale_base(self, chunk: pb.WeightChunk) -> str:
        """Why a delta on (``chunk.base_version``, ``chunk.lineage``) cannot apply here ("" = it can)."""
        served = self.engine.version
        if not self._lineage:
            return (f"base_version: this replica serves version {served} without a delta base (it restarted, "
                    "or its last weights did not come from a push with a lineage): send a full push")
        if chunk.lineage != self._lineage or chunk.base_version != served:
            return (f"base_version: this replica serves version {served} of another lineage or version "
                    f"than the delta's base {chunk.base_version}: send a full push")
        return ""

    def _patches(self, stager: Stager) -> list[SparsePatch]:
        """Decode every SPARSE payload and check it against the weight it patches (nothing applied)."""
        patches = []
        for enc in stager.encoded():
            numel = 1
            for d in enc.shape:
                numel *= d
            patches.append(decode_sparse(enc.name, enc.dtype, numel, enc.changed, enc.payload))
        if not callable(getattr(self.engine, "patch_weights", None)):
            for patch in patches:
                base = self._served.get(patch.name)
                if base is None:
                    raise PushError(f"tensor {patch.name!r}: no served copy to apply a delta to")
                try:
                    patch.validate(base)
                except ValueError as exc:
                    raise PushError(str(exc)) from None
        return patches

    def _loaded(self, stager: Stager, version: int, receive_s: float, load_s: float) -> None:
        self._count("ok")
        if self.metrics is not None:
            self.metrics.bytes.inc(stager.bytes)
            self.metrics.receive.observe(receive_s)
            self.metrics.applied.labels("delta" if stager.delta else "full").inc()
            if stager.delta:
                self.metrics.changed.inc(stager.changed())
        log.info("weights pushed", extra={"version": version, "bytes": stager.bytes, "delta": stager.delta,
                                          "receive_s": round(receive_s, 3), "load_s": round(load_s, 3)})

    async def _apply(self, tensors: list[tuple[str, torch.Tensor]], version: int,
                     patches: list[SparsePatch] | None = None, stager: Stager | None = None) -> None:
        """Load a complete push; with ``adopt_weights`` the staged buffers become the weights (no copy)
        and the pool swaps in the buffers they replaced (see ``StagingPool.handoff``). ``patches``
        (delta pushes) go to ``patch_weights``, or are applied to copies of the served tensors that
        ``load_weights`` gets in full. The lineage is set again only once the load succeeded."""
        patches = patches or []
        delta = stager is not None and stager.delta
        # names, shapes, dtypes (and, for a full push, completeness): checked before the engine
        validate_push(self.engine, tensors, complete=not delta)
        lineage, self._lineage = self._lineage, ""
        patch = getattr(self.engine, "patch_weights", None)
        adopt = getattr(self.engine, "adopt_weights", None)
        try:
            if callable(patch) and (patches or delta):
                replaced = await patch(tensors, patches, version)
            elif callable(adopt):
                replaced = await adopt(tensors, version)
            else:
                tensors = tensors + self._rebuilt(patches)
                await self._load(tensors, version, delta)
                replaced = self._keep_served(tensors, full=not delta)
        except (KeyError, ValueError):  # refused by the engine's validation: nothing changed
            self._lineage = lineage
            raise
        finally:
            self._generation += 1  # conservative: even a refused load counts as a change
        given = dict(tensors)
        for name, old in replaced.items():
            self._pool.handoff(name, given[name], old)
        if stager is not None and stager.kind is not None and stager.kind.lineage:
            self._lineage = stager.kind.lineage if self._pushed_as_served(stager) else ""

    async def _load(self, changed: list[tuple[str, torch.Tensor]], version: int, delta: bool) -> None:
        """``load_weights`` of a push. A delta to an engine that loads only complete pushes (it has
        ``missing_weights``: vLLM) also carries every unchanged weight, from the served copies, so the
        engine reloads the whole model through its exact full-push path. (vLLM reloads layer by layer
        and processes a fused layer, e.g. ``qkv_proj``, only once all its shards arrived; and at RL
        learning rates almost every tensor has some changed element, so a partial reload would save
        little.)"""
        if delta and callable(getattr(self.engine, "missing_weights", None)):
            given = {n for n, _ in changed}
            changed = changed + [(n, t) for n, t in self._served.items() if n not in given]
        await self.engine.load_weights(changed, version)

    def _rebuilt(self, patches: list[SparsePatch]) -> list[tuple[str, torch.Tensor]]:
        """Full tensors for ``load_weights``: each served copy, staged in the pool, with its patch applied."""
        out = []
        for patch in patches:
            base = self._served[patch.name]
            buffer = self._pool.get(patch.name, base.nbytes)
            staged = torch.from_numpy(buffer).view(base.dtype).reshape(base.shape)
            staged.copy_(base)
            patch.apply(staged)
            out.append((patch.name, staged))
        return out

    def _keep_served(self, tensors: list[tuple[str, torch.Tensor]], full: bool) -> dict[str, torch.Tensor]:
        """After ``load_weights``: the loaded tensors are now the served copies (a full push replaces
        them all). Returns the replaced copies, for the pool to take back."""
        replaced = {}
        if full:
            replaced, self._served = self._served, {}
        for name, t in tensors:
            if name in self._served:
                replaced[name] = self._served[name]
            self._served[name] = t
        return {n: t for n, t in replaced.items() if n in dict(tensors)}

    def _pushed_as_served(self, stager: Stager) -> bool:
        """True when the engine serves the pushed tensors in the pushed dtypes (deltas then apply)."""
        if callable(getattr(self.engine, "patch_weights", None)):
            weights = self._weights() or {}
            return all(n in weights and dtype_name(weights[n].dtype) == d for n, d in stager.dtypes().items())
        return all(n in self._served for n in stager.names())

    # ------------------------------------------------------------------ colocated shared memory
    def _weights(self) -> dict[str, torch.Tensor] | None:
        """The engine's live weights by name (tied aliases included), or None if it cannot tell."""
        model = getattr(self.engine, "model", None)
        state_dict = getattr(model, "state_dict", None)
        if not callable(state_dict) or not callable(getattr(self.engine, "adopt_weights", None)):
            return None
        return dict(state_dict(keep_vars=True))

    async def _shm_ready(self, context: grpc.aio.ServicerContext
                         ) -> tuple[ShmSegments, dict[str, torch.Tensor]]:
        weights = self._weights()
        if weights is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "this engine cannot adopt weights from shared memory")
        assert weights is not None
        if self._shm is None:
            try:
                self._shm = await asyncio.to_thread(ShmSegments, weights, self.shm_dir)
            except (OSError, ShmError) as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"shared-memory segments: {exc}")
            assert self._shm is not None
            log.info("shared-memory weight segments created",
                     extra={"paths": [str(p) for p in self._shm.paths], "bytes": self._shm.segment_bytes})
        return self._shm, weights

    async def RegisterShm(self, request: pb.ShmRequest, context: grpc.aio.ServicerContext) -> pb.ShmLayout:
        if not self._authorized(context):
            self._count("unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong weight-push token")
        if request.boot_id and boot_id() and request.boot_id != boot_id():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "boot_id: the trainer runs on another machine; shared memory needs the same "
                                "machine (use PushWeights)")
        async with self._lock:
            shm, weights = await self._shm_ready(context)
            free = shm.free_segment(weights.values())
            if free is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no shared-memory segment is free")
            assert free is not None
            return shm.layout(free, self._generation)

    async def CommitShm(self, request: pb.ShmCommit, context: grpc.aio.ServicerContext) -> pb.PushReply:
        if not self._authorized(context):
            self._count("unauthenticated")
            log.warning("shm commit rejected: missing or wrong token", extra={"peer": context.peer()})
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong weight-push token")
        async with self._lock:
            shm = self._shm
            if shm is None:
                self._count("invalid")
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "no segments yet: call RegisterShm first")
            assert shm is not None
            weights = self._weights() or {}
            free = shm.free_segment(weights.values())
            error = None
            if request.segment not in (0, 1):
                error = (grpc.StatusCode.INVALID_ARGUMENT, f"segment: must be 0 or 1, got {request.segment}")
            elif request.generation != self._generation:
                error = (grpc.StatusCode.FAILED_PRECONDITION,
                         f"generation: {request.generation} is stale (now {self._generation}): the weights "
                         "changed since RegisterShm; register again and rewrite the free segment")
            elif request.segment != free:
                error = (grpc.StatusCode.FAILED_PRECONDITION,
                         f"segment: {request.segment} is not the free segment ({free}); "
                         "it holds served weights")
            if error is not None:
                self._count("invalid")
                log.warning("shm commit rejected", extra={"error": error[1]})
                await context.abort(*error)
            start = time.perf_counter()
            tensors = shm.tensors(request.segment)
            apply = asyncio.ensure_future(self._apply(tensors, int(request.version)))  # clears the lineage
            try:  # like PushWeights: a load that started is finished before the lock is released
                await asyncio.shield(apply)
            except asyncio.CancelledError:
                if not apply.done():
                    await asyncio.wait([apply])
                raise
            except (KeyError, ValueError) as exc:
                self._count("invalid")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"load_weights: {exc}")
            load_s = time.perf_counter() - start
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
            self._count("ok")
            if self.metrics is not None:
                self.metrics.bytes.inc(nbytes)
                self.metrics.applied.labels("shm").inc()
            log.info("weights committed from shared memory",
                     extra={"version": request.version, "segment": request.segment,
                            "load_s": round(load_s, 3)})
            return pb.PushReply(version=self.engine.version, tensors=len(tensors), bytes=nbytes,
                                receive_seconds=0.0, load_seconds=load_s)

    def close(self) -> None:
        """Unlink the shared-memory segments (the served weights stay mapped and valid)."""
        if self._shm is not None:
            self._shm.unlink()

    async def GetVersion(self, request: pb.VersionRequest,
                         context: grpc.aio.ServicerContext) -> pb.VersionReply:
        return pb.VersionReply(version=self.engine.version, serving_dtype=self.serving_dtype(),
                               lineage=self._lineage)

    def handler(self) -> grpc.GenericRpcHandler:
        """Method handlers for the service in proto/retool.proto; ``WeightChunk`` messages are parsed by
        ``decode_chunk`` (wire-compatible, but the tensor bytes stay a view of the received buffer)."""
        return grpc.method_handlers_generic_handler("retool.v1.WeightService", {
            "PushWeights": grpc.stream_unary_rpc_method_handler(
                self.PushWeights, request_deserializer=decode_chunk,
                response_serializer=pb.PushReply.SerializeToString),
            "GetVersion": grpc.unary_unary_rpc_method_handler(
                self.GetVersion, request_deserializer=pb.VersionRequest.FromString,
                response_serializer=pb.VersionReply.SerializeToString),
            "RegisterShm": grpc.unary_unary_rpc_method_handler(
                self.RegisterShm, request_deserializer=pb.ShmRequest.FromString,
                response_serializer=pb.ShmLayout.SerializeToString),
            "CommitShm": grpc.unary_unary_rpc_method_handler(
                self.CommitShm, request_deserializer=pb.ShmCommit.FromString,
                response_serializer=pb.PushReply.SerializeToString),
        })


@dataclass
class WeightServer:
    """A started gRPC server; ``port`` is the bound port (useful with port 0)."""

    server: grpc.aio.Server
    port: int
    servicer: WeightServicer

    async def stop(self, grace: float | None = None) -> None:
        try:
            await self.server.stop(grace)
        finally:
            self.servicer.close()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_weight_server(engine: Engine, host: str, port: int, token: str, *,
                              registry: MetricsRegistry | None = None,
                              max_push_bytes: int | None = None,
                              tls: TLSServerFiles | None = None) -> WeightServer:
    """Start ``WeightService`` for ``engine`` on ``host:port`` (0 = any free port) in the running loop;
    with ``tls`` the port speaks only TLS (mutual TLS when ``tls.client_ca_file`` is set)."""
    keep_freed_buffers()  # message buffers are reused instead of page-faulted afresh
    metrics = WeightPushMetrics(registry) if registry is not None else None
    servicer = WeightServicer(engine, token, metrics, max_push_bytes)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((servicer.handler(),))
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, server_credentials(tls)) if tls is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"could not bind the weight-push server to {host}:{port}")
    await server.start()
    return WeightServer(server, bound, servicer)


async def _serve(model: str, host: str, port: int, token: str, dtype: str = "float32") -> None:
    engine = HFEngine(model, dtype=dtype)
    ws = await start_weight_server(engine, host, port, token)
    print(f"weight server listening on {host}:{ws.port}", flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop cleanly: the shm segments are unlinked
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(ws.server.stop(None)))
    try:
        await ws.wait_for_termination()
    finally:
        ws.servicer.close()
        await engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="A bare rollout replica: HF engine + weight-push gRPC server.")
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-env", default="RETOOL_WEIGHT_TOKEN", help="env var holding the token")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="serving dtype of the engine")
    args = parser.parse_args(argv)
    token = os.environ.get(args.token_env, "").strip()
    if not token:
        parser.error(f"--token-env: the env var {args.token_env} is empty")
    asyncio.run(_serve(args.model, args.host, args.port, token, args.dtype))


if __name__ == "__main__":
    main()
