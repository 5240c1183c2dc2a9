"""gRPC weight-push server of a rollout replica (``retool.v1.WeightService``).

Invariants:
- ``PushWeights`` requires the shared-secret token in the ``x-retool-token`` metadata; a missing
  or wrong token is rejected with UNAUTHENTICATED before any byte is staged; the token is never
  logged;
- a push is staged in CPU memory and handed to ``engine.load_weights`` only once it is complete
  (see ``bucketing.Stager``) and, when the engine can tell, covers every weight of the model; an
  interrupted, malformed or incomplete push changes nothing;
- pushes are received and applied one at a time (a lock): two concurrent pushes never
  interleave, and they can share one set of staging buffers, reused from push to push.

Run standalone (a bare replica for the weight benchmark):
``RETOOL_WEIGHT_TOKEN=... python -m services.rollout.weights.server --model DIR --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import time
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.logging import get_logger
from services.common.metrics import MetricsRegistry
from services.proto_gen import retool_pb2 as pb
from services.rollout.engine.base import Engine
from services.rollout.weights.bucketing import (
    GRPC_BULK_OPTIONS,
    PushError,
    Stager,
    StagingPool,
    decode_chunk,
)
from services.rollout.weights.memory import keep_freed_buffers

log = get_logger("rollout.weights")

TOKEN_METADATA_KEY = "x-retool-token"
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


class WeightServicer:
    """``retool.v1.WeightService``; registered with ``handler()`` so PushWeights decodes zero-copy."""

    def __init__(self, engine: Engine, token: str, metrics: WeightPushMetrics | None = None,
                 max_push_bytes: int | None = None) -> None:
        if not token:
            raise ValueError("token: the weight-push server needs a non-empty token")
        self.engine = engine
        self._token = token.encode()
        self.metrics = metrics
        self.max_push_bytes = max_push_bytes
        self._lock = asyncio.Lock()
        self._pool = StagingPool()

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
                start = start or time.perf_counter()
                stager.add(chunk, data)
            if not stager.complete:
                raise PushError("incomplete push: the stream ended before the message marked last")
            missing_fn = getattr(self.engine, "missing_weights", None)
            missing = missing_fn(stager.names()) if callable(missing_fn) else []
            if missing:
                raise PushError(f"incomplete push: {len(missing)} weights missing, e.g. {missing[:3]}")
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
        try:
            await self.engine.load_weights(stager.tensors(), version)
        except (KeyError, ValueError) as exc:  # the engine validates before it touches anything
            self._count("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"load_weights: {exc}")
        loaded = time.perf_counter()
        self._count("ok")
        if self.metrics is not None:
            self.metrics.bytes.inc(stager.bytes)
            self.metrics.receive.observe(received - (start or received))
        log.info("weights pushed", extra={"version": version, "bytes": stager.bytes,
                                          "receive_s": round(received - (start or received), 3),
                                          "load_s": round(loaded - received, 3)})
        return pb.PushReply(version=self.engine.version, tensors=len(stager.names()), bytes=stager.bytes,
                            receive_seconds=received - (start or received), load_seconds=loaded - received)

    async def GetVersion(self, request: pb.VersionRequest,
                         context: grpc.aio.ServicerContext) -> pb.VersionReply:
        return pb.VersionReply(version=self.engine.version)

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
        })


@dataclass
class WeightServer:
    """A started gRPC server; ``port`` is the bound port (useful with port 0)."""

    server: grpc.aio.Server
    port: int
    servicer: WeightServicer

    async def stop(self, grace: float | None = None) -> None:
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_weight_server(engine: Engine, host: str, port: int, token: str, *,
                              registry: MetricsRegistry | None = None,
                              max_push_bytes: int | None = None) -> WeightServer:
    """Start ``WeightService`` for ``engine`` on ``host:port`` (0 = any free port) in the running loop."""
    keep_freed_buffers()  # message buffers are reused instead of page-faulted afresh
    metrics = WeightPushMetrics(registry) if registry is not None else None
    servicer = WeightServicer(engine, token, metrics, max_push_bytes)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((servicer.handler(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the weight-push server to {host}:{port}")
    await server.start()
    return WeightServer(server, bound, servicer)


async def _serve(model: str, host: str, port: int, token: str) -> None:
    from services.rollout.engine.hf import HFEngine

    engine = HFEngine(model)
    ws = await start_weight_server(engine, host, port, token)
    print(f"weight server listening on {host}:{ws.port}", flush=True)
    try:
        await ws.wait_for_termination()
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="A bare rollout replica: HF engine + weight-push gRPC server.")
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-env", default="RETOOL_WEIGHT_TOKEN", help="env var holding the token")
    args = parser.parse_args(argv)
    token = os.environ.get(args.token_env, "").strip()
    if not token:
        parser.error(f"--token-env: the env var {args.token_env} is empty")
    asyncio.run(_serve(args.model, args.host, args.port, token))


if __name__ == "__main__":
    main()
