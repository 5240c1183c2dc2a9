"""SIGTERM drains a rollout replica before its server stops (what Kubernetes and ``docker compose
stop`` send; the grace periods in deploy/ leave room for ``redis.drain_s``, docs/failure-behaviour.md).

uvicorn's own SIGTERM handling closes the listening sockets before the app's lifespan shutdown, so
nothing could answer ``/healthz`` during a drain done there. ``DrainingServer`` takes the first
SIGTERM itself: it awaits the app's ``drain()`` while the server still serves (``/healthz`` says
``draining``, ``/metrics`` works), and only then stops the server the usual way; the process
exits 0. A second SIGTERM, or a SIGINT, cuts the drain short: the server stops at once, the jobs
still running are cancelled and handed back, and the process ends by that signal (uvicorn
re-raises it). A signal before the server has started is uvicorn's as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

from services.common.logging import get_logger

log = get_logger("rollout")
STARTUP_FAILURE = 3  # uvicorn's exit code when the app's lifespan startup failed


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False  # set in the signal handler itself: a second signal sees it
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first_term = sig == signal.SIGTERM and not self._drain_requested and not self.should_exit
        if first_term and self.started and self._loop is not None:
            self._drain_requested = True
            log.info("SIGTERM: draining (a second SIGTERM or SIGINT cuts the drain short)")
            self._loop.call_soon_threadsafe(self._begin_drain)
            return
        if self._drain_requested and not self.should_exit:
            log.warning("signal %s during the drain: cutting it short", sig)
        super().handle_exit(sig, frame)

    def _begin_drain(self) -> None:
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
            log.info("drained: stopping the server")
        except Exception:
            log.error("drain failed; stopping the server", exc_info=True)
        finally:
            self.should_exit = True


def serve_draining(app: Any, **uvicorn_kwargs: Any) -> None:
    """``uvicorn.run(app, **uvicorn_kwargs)``, with the first SIGTERM awaiting ``app.state.drain()``."""
    server = DrainingServer(uvicorn.Config(app, **uvicorn_kwargs), app.state.drain)
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
