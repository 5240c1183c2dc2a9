"""The shared retry policy (services/common/retry.py) against real loopback HTTP servers."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from services.common.process import free_port
from services.common.retry import (
    MAX_RETRY_AFTER_S,
    RetryableStatus,
    RetryPolicy,
    check_status,
    pause_s,
    retry_call,
    transient_reason,
)


def _counter() -> Counter:
    return Counter("t_retries_total", "retries", ("target", "reason"), registry=CollectorRegistry())


def _count(counter: Counter, target: str, reason: str) -> float:
    return counter.labels(target, reason)._value.get()


class _Server:
    """A loopback HTTP server answering each request with the next status of ``statuses``."""

    def __init__(self, statuses: list[int], retry_after: str | None = None) -> None:
        self.statuses, self.retry_after, self.seen = list(statuses), retry_after, 0

    async def __aenter__(self) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            status = self.statuses[min(self.seen, len(self.statuses) - 1)]
            self.seen += 1
            extra = f"Retry-After: {self.retry_after}\r\n" if self.retry_after else ""
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: 2\r\n{extra}Connection: close\r\n\r\nok"
                         .encode())
            await writer.drain()
            writer.close()

        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()


async def _get(client: httpx.AsyncClient, url: str, timeout: float | None) -> httpx.Response:
    return check_status(await client.get(url, timeout=timeout if timeout is not None else 5.0))


async def test_5xx_then_success_is_retried_and_each_retry_counted():
    counter = _counter()
    async with _Server([503, 502, 200]) as url, httpx.AsyncClient() as client:
        r = await retry_call(lambda t: _get(client, url, t), RetryPolicy(attempts=3, base_s=0.01),
                             target="svc", counter=counter)
    assert r.status_code == 200
    assert _count(counter, "svc", "http_503") == 1 and _count(counter, "svc", "http_502") == 1


async def test_a_4xx_is_final_at_once():
    counter = _counter()
    async with _Server([404, 200]) as srv_url, httpx.AsyncClient() as client:
        server_seen = []

        async def call(t: float | None) -> httpx.Response:
            r = await _get(client, srv_url, t)
            server_seen.append(r.status_code)
            r.raise_for_status()
            return r

        with pytest.raises(httpx.HTTPStatusError):
            await retry_call(call, RetryPolicy(attempts=5, base_s=0.01), target="svc", counter=counter)
    assert server_seen == [404]  # one attempt, nothing counted
    assert sum(m.value for m in counter.collect()[0].samples if m.name.endswith("_total")) == 0


async def test_attempts_bound_the_call_and_the_last_failure_is_raised():
    counter = _counter()
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens: connection refused
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ConnectError):
            await retry_call(lambda t: _get(client, url, t), RetryPolicy(attempts=3, base_s=0.01),
                             target="svc", counter=counter)
    assert _count(counter, "svc", "connect") == 2  # 3 attempts = 2 retries


async def test_the_deadline_bounds_attempts_and_each_attempt_gets_the_time_left():
    lefts: list[float | None] = []

    async def call(left: float | None) -> None:
        lefts.append(left)
        raise httpx.ConnectError("refused")

    policy = RetryPolicy(attempts=None, deadline_s=1.0, base_s=0.05, max_s=0.2)
    with pytest.raises(httpx.ConnectError):
        await retry_call(call, policy, target="svc")
    assert len(lefts) >= 3  # retried while time was left ...
    assert all(x is not None and 0 < x <= 1.0 for x in lefts)
    assert lefts == sorted(lefts, reverse=True)  # ... each attempt with less of it


async def test_retry_after_replaces_the_backoff():
    async with _Server([503, 200], retry_after="0.3") as url, httpx.AsyncClient() as client:
        start = time.monotonic()
        r = await retry_call(lambda t: _get(client, url, t), RetryPolicy(attempts=2, base_s=0.0, max_s=0.0),
                             target="svc")
    assert r.status_code == 200 and time.monotonic() - start >= 0.3  # waited as told, not 0


async def test_a_retry_after_past_the_deadline_gives_up_with_the_answer():
    async with _Server([503], retry_after="5") as url, httpx.AsyncClient() as client:
        start = time.monotonic()
        with pytest.raises(RetryableStatus) as err:
            await retry_call(lambda t: _get(client, url, t), RetryPolicy(attempts=None, deadline_s=1.0),
                             target="svc")
    assert err.value.status == 503 and err.value.retry_after_s == 5.0
    assert time.monotonic() - start < 4  # did not sleep 5 s to fail anyway


def test_pauses_grow_with_jitter_and_stop_at_max():
    policy = RetryPolicy(base_s=0.1, max_s=0.5)
    first = [pause_s(policy, 1, None) for _ in range(200)]
    third = [pause_s(policy, 3, None) for _ in range(200)]
    assert all(0.1 <= p <= 0.2 for p in first) and len(set(first)) > 100  # jittered
    assert all(0.4 <= p <= 0.5 for p in third)
    assert pause_s(policy, 10, None) == 0.5
    answer = httpx.Response(503, headers={"Retry-After": "999"})
    assert pause_s(policy, 1, RetryableStatus(answer)) == MAX_RETRY_AFTER_S


def test_what_counts_as_transient():
    def status_error(code: int) -> httpx.HTTPStatusError:
        request = httpx.Request("GET", "http://x")
        return httpx.HTTPStatusError("x", request=request, response=httpx.Response(code, request=request))

    def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")

    assert transient_reason(httpx.ConnectError("x")) == "connect"
    assert transient_reason(httpx.ReadTimeout("x")) == "timeout"
    assert transient_reason(httpx.RemoteProtocolError("x")) == "transport"
    assert transient_reason(httpx.UnsupportedProtocol("x")) is None
    assert transient_reason(status_error(429)) == "http_429"
    assert transient_reason(status_error(504)) == "http_504"
    assert transient_reason(status_error(422)) is None
    assert transient_reason(rpc_error(grpc.StatusCode.UNAVAILABLE)) == "grpc_unavailable"
    assert transient_reason(rpc_error(grpc.StatusCode.INVALID_ARGUMENT)) is None
    assert transient_reason(ValueError("x")) is None


def test_a_policy_must_be_bounded():
    with pytest.raises(ValueError, match="attempts or deadline_s"):
        RetryPolicy(attempts=None, deadline_s=None)
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
