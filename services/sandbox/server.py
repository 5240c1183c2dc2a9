"""Run the sandbox app under uvicorn (one process; concurrency comes from the zygotes)."""

from __future__ import annotations

import uvicorn

from services.common.logging import get_logger, setup_logging
from services.sandbox.app import create_app
from services.sandbox.config import SandboxConfig
from services.sandbox.preflight import check_isolation_available


def run_server(cfg: SandboxConfig) -> None:
    setup_logging(cfg.log_level)
    check_isolation_available(cfg)

    get_logger("sandbox").info("starting sandbox", extra={"host": cfg.host, "port": cfg.port,
                                                         "max_concurrency": cfg.max_concurrency})
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_config=None, access_log=False,
                timeout_keep_alive=30, backlog=4096, **cfg.security.uvicorn_kwargs())
