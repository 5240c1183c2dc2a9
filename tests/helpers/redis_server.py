"""A private ``redis-server`` on a free loopback port, for tests that need real Redis.

Restartable with the same data directory (append-only file, fsync always) so durability can be
tested. Fails with a clear message when the binary is missing (never falls back to the embedded
Valkey of the demo).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from services.common.redis_server import PrivateRedis


class RedisServer(PrivateRedis):
    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server binary not found on PATH: install it (Debian package "
                               "'redis-server') to run the Redis integration tests")
        super().__init__(data_dir, backend="redis-server", port=port, appendonly=True)
