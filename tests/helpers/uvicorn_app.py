"""An ASGI app served by a real uvicorn on loopback, inside the test's own event loop.

Invariant: the context yields only once the server listens (or fails with "uvicorn did not start"
by ``start_timeout_s``), and on exit the server has shut down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from services.common.process import free_port


@asynccontextmanager
async def serving(app: Any, *, start_timeout_s: float = 30, stop_timeout_s: float = 30,
                  scheme: str = "http", **config: Any) -> AsyncIterator[str]:
    """Yield ``scheme://127.0.0.1:<port>``; ``config`` goes to ``uvicorn.Config`` (e.g. TLS files)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    task = asyncio.create_task(server.serve())
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            assert not task.done() and time.monotonic() < deadline, "uvicorn did not start"
            await asyncio.sleep(0.02)
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, stop_timeout_s)
