"""Async client of the sandbox service (used by the rollout's code tool).

Invariants:
- requests are built from the contract's models (``schemas.py``) and sent with only the fields
  the client sets (``exclude_unset``): the bytes on the wire are what SandboxFusion clients send;
  answers are read back into the contract's models, never used as untyped JSON;
- a sandbox that cannot be reached is an outage, never an answer: after the shared retry policy
  (``services/common/retry.py``: connection errors, 429 and 5xx only, jittered pauses, at most
  ``retries + 1`` attempts within ``request_timeout_s`` for the whole call) ``run`` and
  ``open_session`` raise ``SandboxUnavailable``; every retry is counted in ``retries_counter``
  (``target="sandbox"``, by reason);
- what the sandbox *answered* otherwise (a 4xx, a body that is not the contract's, a session that
  ended, and why) is a ``RunAnswer`` whose ``error`` says what went wrong;
- isolation is checked on every answer: a sandbox under ``isolation: degraded`` sets
  ``X-Sandbox-Isolation`` on each response; each such answer is reported to ``on_degraded`` and,
  unless ``allow_degraded``, refused with ``SandboxDegraded`` (an outage: nothing it ran is used);
- a session lives in one replica's memory: every call of a session goes to the replica that
  opened it, even when the sandbox's name resolves to several.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from services.common.retry import RetryableStatus, RetryPolicy, check_status, retry_call
from services.transport.sandbox.schemas import (
    ISOLATION_HEADER,
    RunCodeRequest,
    RunCodeResponse,
    SandboxHealth,
    SessionCellResponse,
    SessionRequest,
    SessionResponse,
)


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be reached within the retry budget: the rollout must fail, loudly."""


class SandboxDegraded(SandboxUnavailable):
    """The sandbox runs with isolation degraded and this client was not allowed to use it."""


class SessionUnavailable(RuntimeError):
    """No sandbox session could be opened (the sandbox refused one)."""


@dataclass(frozen=True)
class RunAnswer:
    """One ``/run_code`` call: ``response`` when the sandbox answered 200 with a valid body, else
    ``error`` (what went wrong: ``HTTP 422: ...``, the reason a session ended, an invalid body)."""

    response: RunCodeResponse | None
    error: str | None
    latency_s: float


def _describe(exc: BaseException) -> str:
    """What the last attempt ran into, e.g. ``HTTP 504`` or ``ConnectError: ...``."""
    if isinstance(exc, RetryableStatus):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail") or r.text[:200])
    except (ValueError, AttributeError):
        return r.text[:200]


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"


class SandboxClient:
    def __init__(
        self,
        base_url: str,
        *,
        run_timeout_s: float = 10.0,
        memory_mb: int = 1024,
        request_timeout_s: float = 60.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        max_connections: int = 256,
        retries_counter: Any = None,
        client_kwargs: dict[str, Any] | None = None,
        allow_degraded: bool = False,
        on_degraded: Callable[[str, bool], None] | None = None,
    ) -> None:
        """``client_kwargs``: extra ``httpx.AsyncClient`` arguments (``ClientSecurity.httpx_kwargs``:
        the bearer token header, the CA to verify HTTPS with). ``on_degraded(note, allowed)`` is
        called for every answer of a sandbox with isolation degraded."""
        self.run_timeout_s = run_timeout_s
        self.memory_mb = memory_mb
        self.retries = retries
        self.allow_degraded = allow_degraded
        self.on_degraded = on_degraded
        # one budget per call: retries and their pauses included, never more than request_timeout_s
        self.policy = RetryPolicy(attempts=retries + 1, deadline_s=request_timeout_s, base_s=backoff_s,
                                  max_s=max(backoff_s, 5.0))
        self.retries_counter = retries_counter
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=request_timeout_s,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            **(client_kwargs or {}),
        )
        self._session_replica: dict[str, str] = {}  # session id -> base URL of the replica holding it

    @property
    def base_url(self) -> str:
        return str(self._client.base_url).rstrip("/")

    def _isolation(self, r: httpx.Response) -> httpx.Response:
        """``r`` unless it comes from a degraded sandbox this client may not use."""
        note = r.headers.get(ISOLATION_HEADER)
        if note is not None:
            if self.on_degraded is not None:
                self.on_degraded(note, self.allow_degraded)
            if not self.allow_degraded:
                raise SandboxDegraded(
                    f"sandbox {self.base_url} runs with {note}: refused (set "
                    "agent.allow_degraded_sandbox: true to train on it anyway)")
        return r

    async def _replica(self) -> str:
        """The base URL of one sandbox replica: a session lives in one replica's memory, and a
        name that resolves to several (``--scale sandbox=N``) would spread its calls over them."""
        url = self._client.base_url
        host, port = url.host, url.port or (443 if url.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return str(url).rstrip("/")
        v4 = [info for info in infos if info[0] == socket.AF_INET]  # one family: localhost has two
        addresses = sorted({str(info[4][0]) for info in v4 or infos})
        if len(addresses) <= 1:
            return str(url).rstrip("/")
        ip = random.choice(addresses)
        return f"{url.scheme}://{f'[{ip}]' if ':' in ip else ip}:{port}"

    async def health(self, timeout_s: float = 5.0) -> SandboxHealth:
        """``GET /healthz`` once (no retries); raises ``httpx.HTTPError`` or ``ValidationError``."""
        r = await self._client.get("/healthz", timeout=timeout_s)
        r.raise_for_status()
        return SandboxHealth.model_validate(r.json())

    async def open_session(self) -> str:
        """A live sandbox session (``POST /sessions``) on one replica, whose calls all go there;
        raises ``SessionUnavailable`` with the reason."""
        body = SessionRequest(memory_limit_MB=self.memory_mb).model_dump(mode="json", exclude_unset=True)

        async def attempt(timeout: float | None) -> httpx.Response:
            replica = await self._replica()
            r = self._isolation(check_status(
                await self._client.post(f"{replica}/sessions", timeout=timeout, json=body)))
            if r.status_code == 200:
                with contextlib.suppress(ValueError, ValidationError):
                    self._session_replica[SessionResponse.model_validate(r.json()).session_id] = replica
            return r

        try:
            r = await retry_call(attempt, self.policy, target="sandbox", counter=self.retries_counter)
        except (httpx.HTTPError, RetryableStatus) as exc:
            raise SandboxUnavailable(f"could not open a sandbox session ({_describe(exc)})") from exc
        if r.status_code != 200:
            raise SessionUnavailable(
                f"could not open a sandbox session (HTTP {r.status_code}: {r.text[:200]})")
        try:
            return SessionResponse.model_validate(r.json()).session_id
        except (ValueError, ValidationError) as exc:
            raise SessionUnavailable(f"could not open a sandbox session (invalid answer: {exc})") from exc

    async def close_session(self, session_id: str) -> None:
        """End a session; never raises (an unreachable sandbox expires it by its TTL)."""
        replica = self._session_replica.pop(session_id, "")
        with contextlib.suppress(httpx.HTTPError):
            await self._client.delete(f"{replica}/sessions/{session_id}")

    def run_request(self, code: str, session_id: str | None = None) -> RunCodeRequest:
        """The ``/run_code`` request for ``code`` (raises ``ValidationError`` naming the field)."""
        fields: dict[str, Any] = {"code": code, "language": "python", "run_timeout": self.run_timeout_s,
                                  "memory_limit_MB": self.memory_mb}
        if session_id is not None:
            fields["session_id"] = session_id
        return RunCodeRequest(**fields)

    async def run(self, code: str, session_id: str | None = None) -> RunAnswer:
        """Run ``code`` alone, or as the next cell of the live session ``session_id``."""
        start = time.perf_counter()
        try:
            payload = self.run_request(code, session_id).model_dump(mode="json", exclude_unset=True)
        except ValidationError as exc:  # refused here as the sandbox would (422), without a round trip
            return RunAnswer(None, f"invalid request: {_first_error(exc)}", time.perf_counter() - start)
        replica = self._session_replica.get(session_id or "", "")
        attempts = 0

        async def attempt(timeout: float | None) -> httpx.Response:
            nonlocal attempts
            attempts += 1
            return self._isolation(check_status(
                await self._client.post(f"{replica}/run_code", json=payload, timeout=timeout)))

        try:
            r = await retry_call(attempt, self.policy, target="sandbox", counter=self.retries_counter)
        except (httpx.HTTPError, RetryableStatus) as exc:
            raise SandboxUnavailable(
                f"sandbox unavailable after {attempts} attempts in {time.perf_counter() - start:.1f} s "
                f"({_describe(exc)})") from exc
        latency = time.perf_counter() - start
        if r.status_code in (404, 410) and session_id is not None:  # the session ended: say why
            return RunAnswer(None, _detail(r), latency)
        if r.status_code != 200:
            return RunAnswer(None, f"HTTP {r.status_code}: {r.text[:200]}", latency)
        model = SessionCellResponse if session_id is not None else RunCodeResponse
        try:
            return RunAnswer(model.model_validate(r.json()), None, latency)
        except ValueError:  # ValidationError is a ValueError too
            return RunAnswer(None, "response is not a /run_code answer", latency)

    async def aclose(self) -> None:
        await self._client.aclose()
