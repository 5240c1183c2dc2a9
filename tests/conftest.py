"""Shared fixtures: a private Redis server and the sandbox service as real processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.sandbox.launcher import SandboxProcess
from tests.helpers.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def sandbox_url(tmp_path_factory) -> Iterator[str]:
    """A real sandbox service on loopback, shared by the session's integration tests."""
    log = tmp_path_factory.mktemp("sandbox") / "sandbox.log"
    with SandboxProcess(["--set", "max_concurrency=32", "--set", "zygotes=1"], log_path=str(log)) as proc:
        yield proc.url
