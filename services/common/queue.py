"""Redis streams with consumer groups (redis-py asyncio): the prompts and groups queues.

Delivery is at-least-once:
- a consumer reads entries with XREADGROUP; they stay in the group's pending list (PEL) until
  acknowledged with XACK;
- a consumer that crashes leaves its entries pending; any consumer re-claims entries idle for
  longer than a timeout with XAUTOCLAIM (``claim_stale``); a live consumer with long work keeps
  its entries fresh with ``touch`` (XCLAIM to itself, which resets the idle time);
- ``publish_and_ack`` writes a result to the output stream and acknowledges the input entry in
  one MULTI/EXEC transaction (XADD then XACK): an input is never acknowledged without its result
  written. A consumer wrongly presumed dead may still finish, so a result can appear twice;
  readers dedupe on the payload's id (for groups: ``job_id``).
Payloads are opaque bytes (msgpack, see services/common/schemas.py) under the field ``d``.

Across machines the connection is authenticated and encrypted (``RedisAuth``): an ACL user and its
password (read from a file or an env var, never from the URL or a command line) and TLS, verified
against a CA; TLS files upgrade a ``redis://`` URL to TLS, so a deployment that mounts them can
never fall back to plain text.

A client rides out a Redis restart or a network cut: a socket that stays silent for
``SOCKET_TIMEOUT_S`` (longer than any blocking read the services issue) counts as dropped, and a
command that hits a dropped or refused connection is
retried with jittered exponential pauses for about ``REDIS_RETRY_S`` (``connect``, ``REDIS_RETRIES``
retries), then raised. A refusal (wrong password, unknown certificate) looks the same to the client, so
it too is raised only once the retries are spent; a caller that must learn of it at once passes fewer.
Every failed attempt calls the ``CONNECTION_ERROR_HOOKS`` (the services' ``/metrics`` count them),
so an outage the retries hide is still visible. A retried XADD may write an entry twice; readers
dedupe (see above).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from pydantic import Field, model_validator
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.config import ConfigError, StrictModel
from services.common.security import SecretRef, TLSClientFiles

FIELD = b"d"


@dataclass(frozen=True)
class StreamMessage:
    id: str
    data: bytes
    deliveries: int = 1  # known after ``claim_stale``: how often the group delivered this entry


class RedisAuth(StrictModel):
    """Who a client is to Redis (an ACL user) and how it checks the server (TLS)."""

    username: str | None = Field(None, description="ACL user (deploy/: 'trainer' or 'rollout')")
    password: SecretRef = Field(default_factory=SecretRef, description="that user's password")
    tls: TLSClientFiles | None = Field(None, description="TLS to Redis (rediss://), verified with ca_file")

    @model_validator(mode="after")
    def _no_server_name(self) -> RedisAuth:
        if self.tls is not None and self.tls.server_name:
            raise ValueError("tls.server_name: not supported for Redis; the certificate is checked "
                             "against the host of the URL")
        return self


REDIS_RETRY_S = 40.0  # about how long a command waits for a restarting Redis before it fails
REDIS_RETRIES = 12  # retries that span about REDIS_RETRY_S (pauses of 0.5, 1, 2, 4 then 5 s, jittered)
SOCKET_TIMEOUT_S = 30.0  # a silent socket (a cut network) is dropped after this; blocking reads are shorter
CONNECTION_ERROR_HOOKS: list[Callable[[], None]] = []  # called once per failed attempt


class _CountedRetry(Retry):
    async def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        async def counted(error: Exception, *rest: Any) -> Any:
            for hook in CONNECTION_ERROR_HOOKS:
                hook()
            return await fail(error, *rest)

        return await super().call_with_retry(do, counted, *args, **kwargs)


def _retry_kwargs(retries: int) -> dict[str, object]:
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"redis retries: want a whole number >= 0, got {retries!r}")
    return {"retry": _CountedRetry(ExponentialWithJitterBackoff(base=0.5, cap=5.0), retries,
                                   supported_errors=(RedisConnectionError, RedisTimeoutError, OSError)),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError, OSError],
            "socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": 10.0, "socket_keepalive": True}


def connect(url: str, auth: RedisAuth | None = None, *, retries: int = REDIS_RETRIES) -> aioredis.Redis:
    """A client for ``redis[s]://host:port/db`` (bytes responses), as ``auth``'s user over its TLS.

    A command that hits a dropped or refused connection is retried ``retries`` times before it raises.
    """
    if auth is None:
        return aioredis.Redis.from_url(url, decode_responses=False, **_retry_kwargs(retries))
    if "@" in url.split("//", 1)[-1].split("/", 1)[0]:
        raise ConfigError("redis url: put no credentials in the URL; use the auth settings "
                          "(username, password.file)")
    kwargs: dict[str, object] = {}
    password = auth.password.read("redis auth.password")
    if auth.username:
        kwargs["username"] = auth.username
    if password:
        kwargs["password"] = password
    if auth.tls is not None:
        if url.startswith("redis://"):
            url = "rediss://" + url[len("redis://"):]
        kwargs.update(ssl_ca_certs=auth.tls.ca_file, ssl_check_hostname=True, ssl_cert_reqs="required")
        if auth.tls.cert_file:
            kwargs.update(ssl_certfile=auth.tls.cert_file, ssl_keyfile=auth.tls.key_file)
    return aioredis.Redis.from_url(url, decode_responses=False, **kwargs, **_retry_kwargs(retries))


def entry_id(raw: bytes | str) -> str:
    """A stream entry id as ``str``, whether the client decoded responses or not."""
    return raw.decode() if isinstance(raw, bytes) else raw


def stream_messages(entries: list) -> list[StreamMessage]:
    """``(id, fields)`` pairs of XREAD/XCLAIM replies as messages; entries deleted while pending skipped."""
    out = []
    for raw_id, fields in entries:
        if not fields or FIELD not in fields:  # entry deleted while pending: nothing to deliver
            continue
        out.append(StreamMessage(entry_id(raw_id), bytes(fields[FIELD])))
    return out


class RedisStream:
    """One stream and (optionally) one consumer group on it."""

    def __init__(self, client: aioredis.Redis, stream: str, group: str | None = None) -> None:
        self.client = client
        self.stream = stream
        self.group = group

    def _need_group(self) -> str:
        if self.group is None:
            raise ValueError(f"stream {self.stream!r}: this operation needs a consumer group")
        return self.group

    async def ensure_group(self, start_id: str = "0") -> None:
        """Create the group (and the stream) if missing; ``start_id="0"`` delivers earlier entries too."""
        try:
            await self.client.xgroup_create(self.stream, self._need_group(), id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def add(
        self, data: bytes, *, maxlen: int | None = None, extra: dict[str, str] | None = None
    ) -> str:
        """XADD ``data`` (field ``d``) plus optional string fields (e.g. a dead-letter reason)."""
        fields = {FIELD: data, **{k.encode(): v.encode() for k, v in (extra or {}).items()}}
        return entry_id(await self.client.xadd(self.stream, fields, maxlen=maxlen, approximate=True))

    async def read(
        self, consumer: str, *, count: int = 1, block_ms: int | None = None
    ) -> list[StreamMessage]:
        """New entries for ``consumer`` (XREADGROUP ``>``); waits up to ``block_ms`` when none."""
        resp = await self.client.xreadgroup(
            self._need_group(), consumer, {self.stream: ">"}, count=count, block=block_ms
        )
        return [m for _, entries in (resp or []) for m in stream_messages(entries)]

    async def read_own_pending(
        self, consumer: str, *, count: int = 100, after: str = "0"
    ) -> list[StreamMessage]:
        """Entries delivered to ``consumer`` but not acknowledged (a restart under the same name).

        Oldest first, from the entry after ``after``: page through a long pending list by
        passing the last id returned, until an empty page.
        """
        resp = await self.client.xreadgroup(self._need_group(), consumer, {self.stream: after}, count=count)
        return [m for _, entries in (resp or []) for m in stream_messages(entries)]

    async def ack(self, *ids: str, delete: bool = False) -> int:
        """XACK (and XDEL when ``delete``) the given entries; returns how many were pending."""
        if not ids:
            return 0
        if not delete:
            return int(await self.client.xack(self.stream, self._need_group(), *ids))
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self._need_group(), *ids)
            pipe.xdel(self.stream, *ids)
            acked, _ = await pipe.execute()
        return int(acked)

    async def claim_stale(self, consumer: str, *, min_idle_ms: int, count: int = 10) -> list[StreamMessage]:
        """Take over entries pending for more than ``min_idle_ms`` in any consumer (XAUTOCLAIM)."""
        out: list[StreamMessage] = []
        start = "0-0"
        while len(out) < count:
            resp = await self.client.xautoclaim(
                self.stream, self._need_group(), consumer, min_idle_ms, start_id=start, count=count - len(out)
            )
            nxt, entries = entry_id(resp[0]), resp[1]
            out.extend(stream_messages(entries))
            if nxt == "0-0":
                break
            start = nxt
        if not out:
            return out
        async with self.client.pipeline(transaction=False) as pipe:
            for m in out:
                pipe.xpending_range(self.stream, self._need_group(), min=m.id, max=m.id, count=1)
            infos = await pipe.execute()
        return [
            StreamMessage(m.id, m.data, int(info[0]["times_delivered"]) if info else m.deliveries)
            for m, info in zip(out, infos, strict=True)
        ]

    async def touch(self, consumer: str, ids: list[str]) -> None:
        """Reset the idle time of ``consumer``'s in-progress entries so they are not re-claimed."""
        if ids:
            await self.client.xclaim(self.stream, self._need_group(), consumer, 0, ids, justid=True)

    async def depth(self) -> int:
        """Entries in the stream (acknowledged entries count until deleted or trimmed)."""
        return int(await self.client.xlen(self.stream))

    async def pending(self) -> int:
        """Entries delivered to some consumer and not yet acknowledged."""
        info = await self.client.xpending(self.stream, self._need_group())
        return int(info["pending"])

    async def lag(self) -> int:
        """Entries not yet delivered to the group (Redis >= 7 reports it; else counted from XLEN)."""
        group = self._need_group()
        for info in await self.client.xinfo_groups(self.stream):
            name = entry_id(info["name"])
            if name == group:
                lag = info.get("lag")
                if lag is not None:
                    return int(lag)
                # Redis < 7 (no lag, no entries-read): count what lies after the group's cursor
                return await self.count_after(entry_id(info["last-delivered-id"]))
        raise ValueError(f"stream {self.stream!r} has no consumer group {group!r}")

    async def count_after(self, last_id: str, page: int = 1000) -> int:
        """Entries with an id above ``last_id`` (exclusive range, Redis >= 6.2), read in pages of
        ``page`` ids: exact whether or not acknowledged entries were deleted (XLEN is not)."""
        n, start = 0, f"({last_id}"
        while True:
            batch = await self.client.xrange(self.stream, min=start, max="+", count=page)
            n += len(batch)
            if len(batch) < page:
                return n
            start = f"({entry_id(batch[-1][0])}"

    async def backlog(self) -> int:
        """Work outstanding for the group: undelivered + delivered-but-unacknowledged entries."""
        return await self.lag() + await self.pending()


async def publish_and_ack(
    out: RedisStream,
    data: bytes,
    inp: RedisStream,
    ids: list[str],
    *,
    maxlen: int | None = None,
    delete: bool = True,
    extra: dict[str, str] | None = None,
    delete_keys: list[str] | None = None,
) -> str:
    """XADD ``data`` to ``out`` then XACK (and XDEL) ``ids`` on ``inp``, atomically (MULTI/EXEC);
    ``delete_keys`` (e.g. the job's turn checkpoints) are deleted in the same transaction.

    Both streams must live on the same Redis server (``out.client`` is used for the transaction).
    """
    group = inp._need_group()
    async with out.client.pipeline(transaction=True) as pipe:
        fields = {FIELD: data, **{k.encode(): v.encode() for k, v in (extra or {}).items()}}
        pipe.xadd(out.stream, fields, maxlen=maxlen, approximate=True)
        pipe.xack(inp.stream, group, *ids)
        if delete:
            pipe.xdel(inp.stream, *ids)
        if delete_keys:
            pipe.delete(*delete_keys)
        res = await pipe.execute()
    return entry_id(res[0])
