"""Run tool code on the SandboxFusion-compatible sandbox and turn the result into interpreter text.

Invariants:
- a sandbox that cannot be reached is an outage, never a tool result: after the shared retry
  policy (``services/common/retry.py``: connection errors, 429 and 5xx only, jittered pauses, at
  most ``retries + 1`` attempts within ``request_timeout_s`` for the whole call) ``run`` and
  ``open_session`` raise ``SandboxUnavailable``, which fails the whole group (the rollout worker
  leaves its job pending for another try, and dead-letters it after ``max_deliveries``): a
  restarting sandbox must not turn trajectories into "no tools" ones silently (ToRL #27);
- what the sandbox *answered* (a run's failure, a 4xx, odd JSON, a session that ended, and why)
  is a ``ToolResult`` with ``error=True`` and a text saying what went wrong: the model sees it;
- every retry is counted in ``retries_counter`` (``target="sandbox"``, by reason);
- output longer than the limit is cut in the middle.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from dataclasses import dataclass
from typing import Any

import httpx

from services.common.retry import RetryableStatus, RetryPolicy, check_status, retry_call


@dataclass(frozen=True)
class ToolResult:
    text: str
    error: bool
    latency_s: float = 0.0


def format_run_result(body: dict[str, Any], run_timeout_s: float) -> ToolResult:
    """SandboxFusion response -> what the model sees (stdout, then stderr, then the failure if any)."""
    status = body.get("status")
    run = body.get("run_result") or {}
    stdout = str(run.get("stdout") or "")
    stderr = str(run.get("stderr") or "")
    parts = [p for p in (stdout, stderr) if p]
    error = status != "Success"
    run_status = run.get("status")
    if run_status == "TimeLimitExceeded":
        parts.append(f"TimeoutError: execution exceeded {run_timeout_s:g} seconds")
        error = True
    elif status == "SandboxError" or (not run and status != "Success"):
        parts.append(f"Sandbox error: {body.get('message') or status or 'unknown'}")
        error = True
    elif run.get("return_code") not in (0, None):
        error = True
        if not stderr:
            parts.append(f"Process exited with code {run.get('return_code')}")
    return ToolResult("\n".join(p.rstrip("\n") for p in parts), error)


class SessionUnavailable(RuntimeError):
    """No sandbox session could be opened (the sandbox refused one)."""


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be reached within the retry budget: the rollout must fail, loudly."""


def _describe(exc: BaseException) -> str:
    """What the last attempt ran into, e.g. ``HTTP 504`` or ``ConnectError: ...``."""
    if isinstance(exc, RetryableStatus):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail") or r.text[:200])
    except ValueError:
        return r.text[:200]


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
    ) -> None:
        """``client_kwargs``: extra ``httpx.AsyncClient`` arguments (``ClientSecurity.httpx_kwargs``:
        the bearer token header, the CA to verify HTTPS with)."""
        self.run_timeout_s = run_timeout_s
        self.memory_mb = memory_mb
        self.retries = retries
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

    async def open_session(self) -> str:
        """A live sandbox session (``POST /sessions``) on one replica, whose calls all go there;
        raises ``SessionUnavailable`` with the reason."""
        async def attempt(timeout: float | None) -> httpx.Response:
            replica = await self._replica()
            r = check_status(await self._client.post(f"{replica}/sessions", timeout=timeout,
                                                     json={"memory_limit_MB": self.memory_mb}))
            if r.status_code == 200:
                self._session_replica[str(r.json()["session_id"])] = replica
            return r

        try:
            r = await retry_call(attempt, self.policy, target="sandbox", counter=self.retries_counter)
        except (httpx.HTTPError, RetryableStatus) as exc:
            raise SandboxUnavailable(f"could not open a sandbox session ({_describe(exc)})") from exc
        if r.status_code != 200:
            raise SessionUnavailable(
                f"could not open a sandbox session (HTTP {r.status_code}: {r.text[:200]})")
        return str(r.json()["session_id"])

    async def close_session(self, session_id: str) -> None:
        """End a session; never raises (an unreachable sandbox expires it by its TTL)."""
        replica = self._session_replica.pop(session_id, "")
        with contextlib.suppress(httpx.HTTPError):
            await self._client.delete(f"{replica}/sessions/{session_id}")

    async def run(self, code: str, session_id: str | None = None) -> ToolResult:
        """Run ``code`` alone, or as the next cell of the live session ``session_id``."""
        payload: dict[str, Any] = {
            "code": code,
            "language": "python",
            "run_timeout": self.run_timeout_s,
            "memory_limit_MB": self.memory_mb,
        }
        if session_id is not None:
            payload["session_id"] = session_id
        start = time.perf_counter()
        replica = self._session_replica.get(session_id or "", "")
        attempts = 0

        async def attempt(timeout: float | None) -> httpx.Response:
            nonlocal attempts
            attempts += 1
            return check_status(await self._client.post(f"{replica}/run_code", json=payload, timeout=timeout))

        try:
            r = await retry_call(attempt, self.policy, target="sandbox", counter=self.retries_counter)
        except (httpx.HTTPError, RetryableStatus) as exc:
            raise SandboxUnavailable(
                f"sandbox unavailable after {attempts} attempts in {time.perf_counter() - start:.1f} s "
                f"({_describe(exc)})") from exc
        if r.status_code in (404, 410) and session_id is not None:  # the session ended: say why
            return ToolResult(f"Sandbox error: {_detail(r)}", True, time.perf_counter() - start)
        if r.status_code != 200:
            return ToolResult(
                f"Sandbox error: HTTP {r.status_code}: {r.text[:200]}", True, time.perf_counter() - start
            )
        try:
            body = r.json()
        except ValueError:
            return ToolResult("Sandbox error: response is not JSON", True, time.perf_counter() - start)
        body = body if isinstance(body, dict) else {}
        res = format_run_result(body, self.run_timeout_s)
        text = res.text
        if session_id is not None and "ended:" in str(body.get("message") or ""):
            text = "\n".join(p for p in (text, f"Sandbox error: {body['message']}") if p)
        return ToolResult(text, res.error, time.perf_counter() - start)

    async def aclose(self) -> None:
        await self._client.aclose()
