"""Bearer-token door for the HTTP services (sandbox, reward, rollout and its OpenAI routes).

Invariants:
- with a token configured, every HTTP or WebSocket request except the open paths (``/healthz``
  for probes, ``/metrics`` for scrapers: neither carries a secret nor changes anything) must carry
  ``Authorization: Bearer <token>``; anything else is answered 401 with ``WWW-Authenticate:
  Bearer`` before the application sees it (a WebSocket is closed with 1008 instead);
- the server holds only the token's SHA-256 and compares it with the SHA-256 of what was presented,
  in constant time (``hmac.compare_digest``); the token and the presented header are never logged
  nor echoed; refusals are counted by the caller's optional ``on_refused``;
- with no token (``None``) the middleware is not installed at all: loopback-only deployments keep
  their behaviour (``ServerSecurity.require_token`` turns a missing token into a start error).

A pure ASGI middleware, not ``BaseHTTPMiddleware``: streamed answers (SSE) pass through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from fastapi import FastAPI

from services.common.metrics import MetricsRegistry
from services.common.security import ServerSecurity

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/healthz", "/metrics"})


def bearer_ok(headers: Iterable[tuple[bytes, bytes]], digest: bytes) -> bool:
    """Whether the ``authorization`` header is ``Bearer <token>`` (case-insensitive scheme) with
    ``sha256(token) == digest``."""
    for key, value in headers:
        if key.lower() == b"authorization":
            scheme, _, given = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(
                hashlib.sha256(given.strip()).digest(), digest)
    return False


class BearerAuth:
    def __init__(self, app: ASGIApp, digest: bytes, open_paths: frozenset[str] = OPEN_PATHS,
                 on_refused: Callable[[], None] | None = None) -> None:
        if len(digest) != 32:
            raise ValueError("digest: a bearer-token door needs the token's SHA-256 (32 bytes)")
        self.app = app
        self._digest = digest
        self.open_paths = open_paths
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        if bearer_ok(scope.get("headers") or (), self._digest):
            await self.app(scope, receive, send)
            return
        if self.on_refused is not None:
            self.on_refused()
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"detail": "missing or wrong bearer token (header Authorization: Bearer ...)"}
                          ).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="retool"')]})
        await send({"type": "http.response.body", "body": body})


def protect(app: FastAPI, security: ServerSecurity, registry: MetricsRegistry | None = None) -> bool:
    """Install the bearer door on ``app`` when ``security`` has a token (outermost: before any route
    runs); refusals are counted in ``<prefix>_unauthorized_requests_total``. Returns whether a door
    was installed; raises ``ConfigError`` when a required token is missing."""
    digest = security.read_digest("security")
    if digest is not None:
        refused = (registry.counter("unauthorized_requests_total",
                                    "Requests refused: no or wrong bearer token")
                   if registry is not None else None)
        app.add_middleware(BearerAuth, digest=digest, on_refused=refused.inc if refused is not None else None)
    return digest is not None
