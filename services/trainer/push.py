"""Weight push from the trainer to every rollout replica, with discovery, deltas and retries.

Invariants:
- the replica set is resolved again on every attempt (``discovery.resolve``): a ``dns:`` entry
  follows ``docker compose --scale rollout=N`` without a restart;
- weights travel in the replicas' serving dtype (``dtype="auto"``: what GetVersion reports, e.g.
  bf16 for vLLM on GPU, fp32 for the CPU HF engine); the trainer's fp32 master weights stay here;
- ``delta="auto"`` (gRPC): the ``DeltaEncoder`` keeps the weights of the last version exactly as
  pushed (its shadow) and each push sends a replica only the elements that changed, when that
  replica acknowledged the previous version of this pusher's lineage; any other replica (new,
  restarted, missed a push, another dtype) gets a full push, and so does one that refuses the
  delta (FAILED_PRECONDITION: the per-replica fallback). After any chain of deltas a replica
  holds bit for bit the full push of the same version. When a delta saves little (dense changes,
  e.g. fp32 serving), the next ``AUTO_FULL_PUSHES`` pushes are full without computing one;
- ``transport="shm"`` (replicas on this machine, same uid) writes the weights into each replica's
  free shared-memory segment and commits over gRPC (services/transport/weights/shm.py);
- a replica applies a push only once all of it arrived (atomic per replica), so a failed
  attempt is retried whole under the shared policy (``services/common/retry.py``: up to
  ``attempts`` attempts, jittered exponential pauses from ``backoff_s``): replicas that
  acknowledged this version already are skipped; an attempt refused by every failing replica for
  a reason another attempt cannot change (UNAUTHENTICATED, INVALID_ARGUMENT, ...) is not retried;
  every failed attempt is counted (``trainer_weight_push_failures_total``) and every retry too
  (``trainer_retries_total{target="weights"}``);
- ``wait_s=None``: the last failure is raised (the step fails, the trainer exits and resumes from
  its last checkpoint). ``wait_s`` set: it is the deadline of the whole push, every RPC of a push
  has the time left of it as its deadline and retries stop when it is spent; the replicas still
  failing then are *skipped* (``weights/push_unreachable``, a warning) as long as at least one
  replica took the version, and they get a full push at a later push (their acknowledgement is
  forgotten). If no replica took it, the failure is raised;
- per push it reports bytes on the wire, the full-push bytes, density, encode / wire / load
  seconds and how many replicas got a delta or a full push (``weights/push_*`` metrics).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from services.common.logging import get_logger
from services.common.retry import RetryPolicy, retry_call, transient_reason
from services.trainer.discovery import DiscoveryError, resolve
from services.trainer.observability import note_push_failure, retries_counter
from services.transport.weights.bucketing import DTYPES, PushKind
from services.transport.weights.client import (
    PushReport,
    WeightPushError,
    get_replica_state,
    is_stale_base,
    push_state_dict_async,
    push_state_dict_shm_async,
)
from services.transport.weights.delta import DeltaEncoder, EncodedDelta
from services.transport.weights.tls import ChannelSecurity

log = get_logger("trainer.push")

DeltaMode = Literal["auto", "off"]
# auto: a delta whose payload exceeds this fraction of a full push is not worth its encoding ...
AUTO_DENSE_FRACTION = 0.5
# ... and the next this many pushes are full (no encoding); then deltas are tried again
AUTO_FULL_PUSHES = 10


@dataclass
class _Outcome:
    wire_bytes: int = 0
    delta_targets: int = 0
    full_targets: int = 0
    fallbacks: int = 0
    skipped: int = 0
    wire_seconds: float = 0.0
    load_seconds: float = 0.0
    errors: dict[str, str] = field(default_factory=dict)
    causes: dict[str, BaseException] = field(default_factory=dict)  # target -> what it failed with

    def add(self, report: PushReport, targets: list[str], delta: bool) -> None:
        replies = report.replies
        self.wire_bytes += report.bytes * len(targets)
        for t in targets:
            r = replies.get(t, {})
            self.wire_seconds = max(self.wire_seconds, float(r.get("receive_seconds", 0.0)))
            self.load_seconds = max(self.load_seconds, float(r.get("load_seconds", 0.0)))
        if delta:
            self.delta_targets += len(targets)
        else:
            self.full_targets += len(targets)


class WeightPusher:
    """The trainer's weight push: one per run (it remembers what each replica acknowledged)."""

    def __init__(self, entries: list[str], token: str, *, bucket_bytes: int,
                 transport: Literal["grpc", "shm"] = "grpc", delta: DeltaMode = "auto", dtype: str = "auto",
                 attempts: int = 3, backoff_s: float = 2.0, encode_threads: int = 2,
                 wait_s: float | None = None, encode_where: Literal["host", "device"] = "host",
                 security: ChannelSecurity | None = None) -> None:
        if wait_s is not None and wait_s <= 0:
            raise ValueError(f"wait_s: must be > 0 (or None), got {wait_s}")
        self.entries, self.token, self.bucket_bytes = entries, token, bucket_bytes
        self.transport, self.delta_mode, self.dtype = transport, delta, dtype
        self.encode_threads, self.wait_s = encode_threads, wait_s
        # one budget per push: ``attempts`` whole attempts within ``wait_s`` (pauses included); every
        # RPC of an attempt gets the time left as its deadline
        self.policy = RetryPolicy(attempts=attempts, deadline_s=wait_s, base_s=backoff_s,
                                  max_s=max(backoff_s, 30.0))
        self.encode_where = encode_where  # "device": the delta compare runs where the master weights are
        self.security = security  # TLS of every channel (None: plain text, loopback deployments)
        self.encoder: DeltaEncoder | None = None  # the shadow, in the serving dtype
        self._acked: dict[str, tuple[str, int]] = {}  # target -> (lineage, version) it acknowledged
        self._dtypes: dict[str, str] = {}  # target -> serving dtype it reported
        self._last: EncodedDelta | None = None  # the delta of the latest version (reused by retries)
        self._full_left = 0  # auto: full pushes left before deltas are tried again

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Push ``weights`` (trainer names; an ``lm.`` prefix is dropped) to every resolved replica."""
        start = time.perf_counter()
        named = [(k.removeprefix("lm."), v) for k, v in weights.items()]
        total: dict[str, float] = {}  # the metrics of every attempt of this push
        last: dict[str, Any] = {"metrics": None, "targets": [], "errors": {}}  # of the latest attempt
        attempt_no = 0

        async def attempt(timeout: float | None) -> dict[str, float]:
            nonlocal total, attempt_no
            attempt_no += 1
            last.update(metrics=None, targets=[], errors={})
            try:
                targets = last["targets"] = resolve(self.entries)
                if self.transport == "shm":
                    seconds, gbps = await _push_shm(named, targets, version, self.token, self.security)
                    self._acked.clear()  # a commit clears the replicas' lineage
                    return {"weights/push_seconds": seconds, "weights/push_gbps": gbps,
                            "weights/push_targets": float(len(targets))}
                metrics, errors, causes = await self._push_grpc(named, targets, version, timeout)
                last.update(metrics=_merged(total, metrics), errors=errors)
                total = last["metrics"]
                if not errors:
                    total["weights/push_seconds"] = time.perf_counter() - start
                    return total
                raise WeightPushError(f"weight push of version {version} failed: {json.dumps(errors)}",
                                      errors, causes)
            except (WeightPushError, DiscoveryError, OSError) as exc:
                note_push_failure()
                log.warning("weight push failed", extra={
                    "version": version, "attempt": attempt_no, "of": self.policy.attempts,
                    "error": str(exc)[:1000]})
                raise

        try:
            return await retry_call(attempt, self.policy, target="weights", counter=retries_counter(),
                                    classify=_push_reason)
        except (WeightPushError, DiscoveryError, OSError) as exc:
            metrics, targets, errors = last["metrics"], last["targets"], last["errors"]
            if self.wait_s is not None and metrics is not None:
                unreachable = [t for t in targets if t in errors]
                if len(unreachable) < len(targets):  # some replica took this version
                    for t in unreachable:  # a full push when it is back
                        self._acked.pop(t, None)
                    log.warning("weight push: replicas skipped (unreachable within weight_push_wait_s)",
                                extra={"version": version, "skipped": unreachable, "wait_s": self.wait_s,
                                       "error": str(exc)[:1000]})
                    metrics["weights/push_unreachable"] = float(len(unreachable))
                    metrics["weights/push_seconds"] = time.perf_counter() - start
                    return metrics
            raise

    async def _serving_dtypes(self, targets: list[str], timeout_s: float | None) -> dict[str, BaseException]:
        """Ask the targets not seen yet for their serving dtype; returns those that did not answer."""
        unknown = [t for t in targets if t not in self._dtypes]
        wait = min(10.0, timeout_s) if timeout_s is not None else 10.0
        states = await asyncio.gather(*(get_replica_state(t, wait, self.security) for t in unknown),
                                      return_exceptions=True)
        failed = {t: s for t, s in zip(unknown, states, strict=True) if isinstance(s, BaseException)}
        for t, s in zip(unknown, states, strict=True):
            if not isinstance(s, BaseException):
                self._dtypes[t] = s.serving_dtype or ""
        return failed

    def _dtype(self, targets: list[str], master: torch.dtype) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        reported = [self._dtypes[t] for t in targets if self._dtypes.get(t) in DTYPES]
        return DTYPES[max(set(reported), key=reported.count)] if reported else master

    async def _push_grpc(self, named: list[tuple[str, torch.Tensor]], targets: list[str], version: int,
                         timeout_s: float | None
                         ) -> tuple[dict[str, float], dict[str, str], dict[str, BaseException]]:
        """One attempt: the metrics and, by target, what failed (those targets did not take it) and
        the exception it failed with."""
        start = time.perf_counter()
        unanswered = await self._serving_dtypes(targets, timeout_s)
        targets = [t for t in targets if t not in unanswered]
        master = named[0][1].dtype if named else torch.float32
        dtype = self._dtype(targets, master)
        if self.encoder is None or self.encoder.dtype != dtype:
            if self.encoder is not None:
                self.encoder.close()
            self.encoder = DeltaEncoder(dtype, threads=self.encode_threads, where=self.encode_where)
            self._last = None
        enc = self.encoder
        encode_s = 0.0
        if enc.version != version:  # not a retry of the same version
            t0 = time.perf_counter()
            compare = self.delta_mode == "auto" and self._full_left == 0
            self._last = enc.update(named, version, compare=compare)
            self._full_left = max(0, self._full_left - 1)
            saved_little = self._last is not None and (
                self._last.payload_bytes > AUTO_DENSE_FRACTION * self._last.full_bytes)
            if saved_little:
                self._full_left = AUTO_FULL_PUSHES  # a delta that saves little: full pushes for a while
            encode_s = time.perf_counter() - t0
        delta = self._last
        full_bytes = sum(t.numel() * t.element_size() for _, t in enc.full())
        dtype_str = str(dtype).removeprefix("torch.")
        same_dtype = [t for t in targets if self._dtypes.get(t, "") in ("", dtype_str)]
        current = [t for t in targets if self._acked.get(t) == (enc.lineage, version)]
        base = (enc.lineage, delta.base_version) if delta is not None else None
        delta_targets = [t for t in same_dtype if base and t not in current and self._acked.get(t) == base]
        full_targets = [t for t in targets if t not in current and t not in delta_targets]
        out = _Outcome(skipped=len(current), causes=dict(unanswered),
                       errors={t: f"GetVersion: {str(e)[:300]}" for t, e in unanswered.items()})
        if delta is not None and delta_targets:
            full_targets += await self._deltas(delta, delta_targets, version, out, timeout_s)
        if full_targets:
            kind = PushKind(lineage=enc.lineage)
            await self._full(full_targets, version, dtype, named, out, kind, timeout_s)
        seconds = time.perf_counter() - start
        density = delta.density if delta is not None and out.delta_targets else 1.0
        return {
            "weights/push_seconds": seconds,
            "weights/push_gbps": full_bytes / 1e9 / seconds if seconds > 0 else 0.0,
            "weights/push_targets": float(len(targets)),
            "weights/push_delta_targets": float(out.delta_targets),
            "weights/push_full_targets": float(out.full_targets),
            "weights/push_fallbacks": float(out.fallbacks),
            "weights/push_wire_bytes": float(out.wire_bytes),
            "weights/push_full_bytes": float(full_bytes),
            "weights/push_density": density,
            "weights/push_encode_seconds": encode_s,
            "weights/push_wire_seconds": out.wire_seconds,
            "weights/push_load_seconds": out.load_seconds,
            "weights/push_unreachable": 0.0,
        }, out.errors, out.causes

    async def _deltas(self, delta: EncodedDelta, targets: list[str], version: int,
                      out: _Outcome, timeout_s: float | None) -> list[str]:
        """The delta to each target on its own (one stale replica must not cancel the others);
        returns the targets that refused it as stale (they get a full push); failures go to ``out``."""
        assert self.encoder is not None
        kind = PushKind(delta=True, base_version=delta.base_version, lineage=self.encoder.lineage)
        reports = await asyncio.gather(*(
            push_state_dict_async(delta.tensors, [t], version, self.token, self.bucket_bytes, timeout_s,
                                  kind=kind, security=self.security)
            for t in targets), return_exceptions=True)
        stale = []
        for t, r in zip(targets, reports, strict=True):
            if isinstance(r, WeightPushError) and is_stale_base(r.errors.get(t, r)):
                stale.append(t)
                out.fallbacks += 1
                self._acked.pop(t, None)
                log.info("replica refused the delta (stale base): full push",
                         extra={"target": t, "error": r.results.get(t)})
            elif isinstance(r, BaseException):
                self._acked.pop(t, None)
                out.errors[t] = f"delta: {str(r)[:300]}"
                out.causes[t] = r.errors.get(t, r) if isinstance(r, WeightPushError) else r
            else:
                out.add(r, [t], delta=True)
                self._acked[t] = (self.encoder.lineage, version)
        return stale

    async def _full(self, targets: list[str], version: int, dtype: torch.dtype,
                    named: list[tuple[str, torch.Tensor]], out: _Outcome, kind: PushKind,
                    timeout_s: float | None) -> None:
        """One fan-out full push: the encoder's weights to replicas of its dtype, a cast of the master
        weights (no lineage) to any other. Targets that fail go to ``out.errors``; those that answered
        "ok" before a failure cancelled the rest took the version."""
        assert self.encoder is not None
        name = str(dtype).removeprefix("torch.")
        groups: dict[str, list[str]] = {}
        for t in targets:
            groups.setdefault(self._dtypes.get(t) or name, []).append(t)
        for t in targets:
            self._acked.pop(t, None)
        for group_dtype, group in groups.items():
            ours = group_dtype == name
            pending = group
            while pending:  # a fan-out cancels the rest when one target fails: push again without it
                try:
                    if ours:
                        report = await push_state_dict_async(
                            self.encoder.full(), pending, version, self.token, self.bucket_bytes, timeout_s,
                            kind=kind, security=self.security)
                    else:  # no lineage: such a replica never gets deltas from this shadow
                        cast = getattr(torch, group_dtype)
                        report = await push_state_dict_async(
                            ((n, t.to(cast)) for n, t in named), pending, version, self.token,
                            self.bucket_bytes, timeout_s, security=self.security)
                    took, retry = pending, []
                    out.add(report, pending, delta=False)
                except WeightPushError as exc:
                    took = [t for t in pending if exc.results.get(t) == "ok"]
                    failed = {t: r for t, r in exc.results.items()
                              if r != "ok" and not r.startswith(CANCELLED)}
                    cancelled = [t for t in pending if t not in took and t not in failed]
                    retry = cancelled if failed and cancelled else []
                    lost = {t: r for t, r in exc.results.items() if r != "ok" and t not in retry}
                    out.errors.update({t: f"full: {r}" for t, r in lost.items()})
                    out.causes.update({t: exc.errors.get(t, exc) for t in lost})
                    out.full_targets += len(took)
                    if retry:
                        log.info("weight push: again to the replicas a failed one cancelled",
                                 extra={"version": version, "failed": sorted(failed), "again": retry})
                if ours:
                    for t in took:
                        self._acked[t] = (self.encoder.lineage, version)
                pending = retry

    def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()


CANCELLED = "cancelled (another target failed)"  # services/transport/weights/client.py's result text
# a push refused for one of these on every failing replica is not retried: another attempt would
# send the same token and the same tensors
_FINAL_GRPC = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "UNIMPLEMENTED"})


def _push_reason(exc: BaseException) -> str | None:
    """Retry reason of a failed push attempt (``retry_call``'s ``classify``); None: final."""
    if isinstance(exc, DiscoveryError):
        return "discovery"
    if isinstance(exc, WeightPushError):
        causes = list(exc.errors.values())
        codes = [getattr(c.code(), "name", "") if callable(getattr(c, "code", None)) else "" for c in causes]
        if causes and all(code in _FINAL_GRPC for code in codes):
            return None
        return next((r for c in causes if (r := transient_reason(c))), "push_failed")
    if isinstance(exc, OSError):
        return "os_error"
    return transient_reason(exc)


_SUMMED = ("weights/push_delta_targets", "weights/push_full_targets", "weights/push_fallbacks",
           "weights/push_wire_bytes", "weights/push_encode_seconds")
_MAXED = ("weights/push_wire_seconds", "weights/push_load_seconds")


def _merged(total: dict[str, float], attempt: dict[str, float]) -> dict[str, float]:
    """The metrics of a push over its attempts: counts and bytes summed, slowest replica kept, the rest
    (targets, density, ...) from the latest attempt."""
    out = {**total, **attempt}
    for key in _SUMMED:
        out[key] = total.get(key, 0.0) + attempt.get(key, 0.0)
    for key in _MAXED:
        out[key] = max(total.get(key, 0.0), attempt.get(key, 0.0))
    if not attempt.get("weights/push_delta_targets") and total.get("weights/push_delta_targets"):
        out["weights/push_density"] = total["weights/push_density"]  # the delta's, not a retry's
    return out


async def push_weights(
    weights: Mapping[str, torch.Tensor],
    entries: list[str],
    version: int,
    token: str,
    *,
    bucket_bytes: int,
    attempts: int = 3,
    backoff_s: float = 2.0,
    transport: Literal["grpc", "shm"] = "grpc",
) -> dict[str, float]:
    """One push with a fresh ``WeightPusher`` (full pushes: it has no shadow yet)."""
    pusher = WeightPusher(entries, token, bucket_bytes=bucket_bytes, transport=transport, attempts=attempts,
                          backoff_s=backoff_s)
    try:
        return await pusher.push(weights, version)
    finally:
        pusher.close()


async def _push_shm(
    named: list[tuple[str, torch.Tensor]], targets: list[str], version: int, token: str,
    security: ChannelSecurity | None = None,
) -> tuple[float, float]:
    """Every replica through its shared memory, concurrently; (seconds, GB/s of one replica's bytes)."""
    start = time.perf_counter()
    outcomes = await asyncio.gather(
        *(push_state_dict_shm_async(named, t, version, token, security=security) for t in targets),
        return_exceptions=True,
    )
    failed = {t: str(o)[:300] for t, o in zip(targets, outcomes, strict=True) if isinstance(o, BaseException)}
    if failed:
        raise WeightPushError(f"shared-memory push of version {version} failed: {json.dumps(failed)}", failed)
    seconds = time.perf_counter() - start
    nbytes = outcomes[0].bytes if outcomes else 0  # type: ignore[union-attr]
    return seconds, nbytes / seconds / 1e9 if seconds > 0 else 0.0
