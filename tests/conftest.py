"""Shared fixtures: a private Redis server and the sandbox service as real processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.sandbox.launcher import SandboxProcess
from tests.helpers.redis_server import RedisServer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests need CUDA: on a machine without it they are skipped and say so (CPU CI also
    deselects them with ``-m "not gpu"``)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="gpu: no CUDA device on this machine"))


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


SANDBOX_SECRET = "s3cr3t-weight-token-7f1c2a"


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory) -> Iterator[SandboxProcess]:
    """A real sandbox service on loopback, shared by the session's integration tests.

    Its environment holds a secret that no sandboxed run may ever see.
    """
    log = tmp_path_factory.mktemp("sandbox") / "sandbox.log"
    args = ["--set", "max_concurrency=32", "--set", "zygotes=1", "--set", "light_zygotes=1",
            "--set", "max_output_bytes=4096"]
    with SandboxProcess(args, log_path=str(log), env={"RETOOL_WEIGHT_TOKEN": SANDBOX_SECRET}) as proc:
        yield proc


@pytest.fixture(scope="session")
def sandbox_url(sandbox: SandboxProcess) -> str:
    return sandbox.url
