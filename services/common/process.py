"""Start a ``retool`` service as a real child process on a loopback port and wait for health.

Used by the demo, the benchmarks and the integration tests. Invariant: ``__exit__`` leaves
no child behind (terminate, then kill after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_http_healthy(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before {url} became healthy")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s (last: {last})")


class ServiceProcess:
    """``retool <args> --host 127.0.0.1 --port P`` as a subprocess; ``url`` once healthy."""

    def __init__(self, args: Sequence[str], *, port: int | None = None, host: str = "127.0.0.1",
                 env: Mapping[str, str] | None = None, health_path: str = "/healthz",
                 startup_timeout_s: float = 90.0, log_path: str | Path | None = None,
                 wrapper: Sequence[str] = ()) -> None:
        self.host = host
        self.wrapper = list(wrapper)  # e.g. ["unshare", "--pid", "--fork", ...]: runs the service under it
        self.port = port or free_port(host)
        self.args = [*args, "--host", host, "--port", str(self.port)]
        self.env = {**os.environ, **(env or {})}
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServiceProcess:
        out = subprocess.DEVNULL
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            out = self._log
        self.proc = subprocess.Popen([*self.wrapper, sys.executable, "-m", "services.cli", *self.args],
                                     env=self.env, stdout=out, stderr=out, start_new_session=True)
        try:
            wait_http_healthy(self.url + self.health_path, self.startup_timeout_s, self.proc)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, 9)
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
