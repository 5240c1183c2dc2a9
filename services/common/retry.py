"""The one retry policy for calls to another service: jittered exponential pauses under one deadline.

Built on tenacity (``AsyncRetrying``), as prime-rl and AReaL do; this module only fixes the policy
and what counts as transient, so every caller retries the same way.

Invariants:
- only transient failures are retried (``transient_reason``): transport errors (connection
  refused or reset, time-outs, broken protocol on the wire), HTTP 429 and 5xx (the caller raises
  ``RetryableStatus`` for those), gRPC UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED /
  ABORTED, or what the caller's own ``classify`` says; anything else (a 4xx, a refused push) is
  raised at once;
- one budget per call, never one per layer: at most ``attempts`` attempts and, with
  ``deadline_s``, no pause that would end past the deadline (counted from the first attempt);
  each attempt gets the time left (``fn(time_left)``) for its own I/O timeout, so an attempt
  cannot outlive the call and nothing nests;
- a pause is ``base_s * 2**(retry - 1)`` plus a uniform jitter in ``[0, base_s]``, at most
  ``max_s``, or the server's ``Retry-After``
  (``RetryableStatus.retry_after_s``, at most ``MAX_RETRY_AFTER_S``) when it gave one;
- every retry is counted in ``counter`` (a Prometheus counter with labels ``target, reason``)
  before its pause, and the last failure is raised unchanged: callers turn it into their own
  typed error (``WeightPushError``, ``RewardUnavailable``, a sandbox error text).
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    stop_never,
)

from services.common.logging import get_logger

T = TypeVar("T")
log = get_logger("retry")

MAX_RETRY_AFTER_S = 30.0
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# gRPC codes worth another attempt: the peer is down, slow or busy, not refusing the request
RETRY_GRPC = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED"})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long one call may be tried (see the module's invariants)."""

    attempts: int | None = 3  # None: as many as the deadline allows
    deadline_s: float | None = None  # None: only ``attempts`` bounds the call
    base_s: float = 0.2
    max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts is None and self.deadline_s is None:
            raise ValueError("RetryPolicy: attempts or deadline_s must bound the retries")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts: must be >= 1, got {self.attempts}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"RetryPolicy.deadline_s: must be > 0, got {self.deadline_s}")


class RetryableStatus(Exception):
    """An HTTP answer worth retrying (429, 5xx); ``response`` is kept for the caller's final error."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.status = response.status_code
        self.retry_after_s = retry_after_s(response)


def retry_after_s(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (integer or decimal form), capped; None when absent or unreadable."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(value)))
    except ValueError:
        return None


def check_status(response: httpx.Response) -> httpx.Response:
    """Raise ``RetryableStatus`` for a 429 or 5xx answer; any other response is returned as is."""
    if response.status_code in RETRY_STATUS:
        raise RetryableStatus(response)
    return response


def transient_reason(exc: BaseException) -> str | None:
    """A short label for a transient failure (the ``reason`` of the retry counter), None if final."""
    if isinstance(exc, RetryableStatus):
        return f"http_{exc.status}"
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        return f"http_{code}" if code in RETRY_STATUS else None
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError):
        return None  # our request is wrong: another attempt sends the same
    if isinstance(exc, httpx.TransportError):
        return "transport"
    code = getattr(exc, "code", None)
    if callable(code) and type(exc).__module__.startswith("grpc"):  # grpc.aio.AioRpcError
        name = getattr(code(), "name", "")
        return f"grpc_{name.lower()}" if name in RETRY_GRPC else None
    return None


def pause_s(policy: RetryPolicy, retry: int, exc: BaseException | None) -> float:
    """The pause before retry number ``retry`` (1 = the first): the server's ``Retry-After`` when
    ``exc`` carries one, else ``base_s * 2**(retry - 1)`` plus a jitter in ``[0, base_s]``, at most
    ``max_s`` (the formula of tenacity's ``wait_exponential_jitter``)."""
    hint = getattr(exc, "retry_after_s", None)
    if hint is not None:
        return float(hint)
    return min(policy.max_s, policy.base_s * 2 ** (retry - 1) + random.uniform(0, policy.base_s))


async def retry_call(
    fn: Callable[[float | None], Awaitable[T]],
    policy: RetryPolicy,
    *,
    target: str,
    counter: Any = None,
    classify: Callable[[BaseException], str | None] = transient_reason,
) -> T:
    """``await fn(time_left)`` until it returns, under ``policy``; raises the last failure.

    ``time_left`` is the seconds until the policy's deadline (None without one): the attempt's
    own timeout. ``counter`` (labels ``target, reason``) counts every retry.
    """
    stop = stop_after_attempt(policy.attempts) if policy.attempts is not None else stop_never
    if policy.deadline_s is not None:
        stop = stop | stop_before_delay(policy.deadline_s)

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        reason = classify(exc) if exc is not None else None
        if counter is not None:
            counter.labels(target, reason or "other").inc()
        log.info("retrying", extra={"target": target, "reason": reason, "attempt": state.attempt_number,
                                    "pause_s": round(state.upcoming_sleep, 3), "error": str(exc)[:300]})

    def wait(state: RetryCallState) -> float:
        return pause_s(policy, state.attempt_number, state.outcome.exception() if state.outcome else None)

    retrying = AsyncRetrying(stop=stop, wait=wait, reraise=True, before_sleep=before_sleep,
                             retry=retry_if_exception(lambda e: classify(e) is not None))
    start = time.monotonic()
    async for attempt in retrying:
        with attempt:
            left = None
            if policy.deadline_s is not None:
                left = max(0.001, policy.deadline_s - (time.monotonic() - start))
            return await fn(left)
    raise AssertionError("unreachable: tenacity either returns or re-raises")  # pragma: no cover
