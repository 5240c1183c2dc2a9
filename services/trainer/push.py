"""Weight push from the trainer to every rollout replica, with discovery and retries.

Invariants:
- the replica set is resolved again on every attempt (``discovery.resolve``): a ``dns:`` entry
  follows ``docker compose --scale rollout=N`` without a restart;
- ``transport="shm"`` (replicas on this machine, same uid) writes the weights into each replica's
  free shared-memory segment and commits over gRPC (services/rollout/weights/shm.py); the
  replicas are pushed concurrently and the push fails as a whole if any replica fails, as with
  ``grpc``;
- a replica applies a push only once all of it arrived (atomic per replica), so a failed
  attempt is retried whole, to every replica, up to ``attempts`` times: replicas that already
  took this version load the same weights under the same version again (harmless); every
  failed attempt is counted (``trainer_weight_push_failures_total``) before the last failure
  is raised (the step fails, the trainer exits and resumes from its last checkpoint).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Literal

import torch

from services.common.logging import get_logger
from services.trainer.discovery import DiscoveryError, resolve
from services.trainer.observability import note_push_failure

log = get_logger("trainer.push")


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
    """Push ``weights`` (trainer names; an ``lm.`` prefix is dropped) to every resolved replica."""
    from services.rollout.weights.client import WeightPushError

    last: Exception | None = None
    for attempt in range(1, attempts + 1):
        try:
            targets = resolve(entries)
            named = [(k.removeprefix("lm."), v) for k, v in weights.items()]
            if transport == "shm":
                seconds, gbps = await _push_shm(named, targets, version, token)
            else:
                from services.rollout.weights.client import push_state_dict_async

                report = await push_state_dict_async(
                    named, targets, version, token, bucket_bytes=bucket_bytes
                )
                seconds, gbps = report.seconds, report.gbps
            return {
                "weights/push_seconds": seconds,
                "weights/push_gbps": gbps,
                "weights/push_targets": float(len(targets)),
            }
        except (WeightPushError, DiscoveryError, OSError) as exc:
            last = exc
            note_push_failure()
            log.warning(
                "weight push failed",
                extra={"version": version, "attempt": attempt, "of": attempts, "error": str(exc)[:1000]},
            )
            if attempt < attempts:
                await asyncio.sleep(backoff_s * attempt)
    assert last is not None
    raise last


async def _push_shm(
    named: list[tuple[str, torch.Tensor]], targets: list[str], version: int, token: str
) -> tuple[float, float]:
    """Every replica through its shared memory, concurrently; (seconds, GB/s of one replica's bytes)."""
    import time

    from services.rollout.weights.client import WeightPushError, push_state_dict_shm_async

    start = time.perf_counter()
    outcomes = await asyncio.gather(
        *(push_state_dict_shm_async(named, t, version, token) for t in targets), return_exceptions=True
    )
    failed = {t: str(o)[:300] for t, o in zip(targets, outcomes, strict=True) if isinstance(o, BaseException)}
    if failed:
        raise WeightPushError(f"shared-memory push of version {version} failed: {json.dumps(failed)}", failed)
    seconds = time.perf_counter() - start
    nbytes = outcomes[0].bytes if outcomes else 0  # type: ignore[union-attr]
    return seconds, nbytes / seconds / 1e9 if seconds > 0 else 0.0
