"""A private Redis for single-machine runs (the demo): a real ``redis-server`` when installed,
else an embedded fakeredis TCP server, both speaking RESP on a free loopback port.

Invariants: the queue code (services/common/queue.py) only ever sees a ``redis://`` URL, so the
backend is invisible to it; a started server is stopped by ``stop()`` / the context manager
(the child process is terminated, the embedded server's thread shut down); nothing listens on
anything but 127.0.0.1. The fakeredis fallback is in-memory and single-node (no durability, no
restart); it implements every stream command queue.py uses (XGROUP CREATE MKSTREAM, XADD, XREADGROUP
with BLOCK, XACK, XDEL, XCLAIM JUSTID, XAUTOCLAIM, XPENDING, XLEN, XINFO GROUPS, MULTI/EXEC).
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Literal

from services.common.process import free_port

Backend = Literal["auto", "redis-server", "fakeredis"]


def _keep_alive_handler() -> type:
    """fakeredis' TCP handler closes the connection after any error reply (e.g. BUSYGROUP from an
    idempotent XGROUP CREATE); a real server keeps it open, and redis-py's asyncio pool relies on
    that. This handler sends the error and keeps serving the connection."""
    import select

    import redis
    from fakeredis._clients._tcp_server import TCPFakeRequestHandler

    class KeepAliveHandler(TCPFakeRequestHandler):
        def handle(self) -> None:
            while not self.server._shutdown_event.is_set():
                try:
                    if self.current_client.can_read():
                        try:
                            response = self.current_client.read_response()
                        except redis.ResponseError as exc:  # a command error: reply, keep the connection
                            response = exc
                        self.writer.dump(response)
                        continue
                    data = self.rfile.readline()
                    if data == b"":
                        readable, _, _ = select.select([self.connection], [], [], 0.01)
                        if not readable:
                            continue
                        data = self.rfile.readline()
                        if data == b"":
                            break
                    self.current_client.get_socket().sendall(data)
                except ConnectionError:
                    break
                except Exception as exc:  # protocol-level failure: report and close, as fakeredis does
                    self.writer.dump(exc)
                    break

    return KeepAliveHandler


def _patch_fakeredis_block() -> None:
    """fakeredis 2.40 answers ``XREADGROUP COUNT n BLOCK ms`` at once when nothing is new (it only
    blocks without COUNT), which would turn the worker's and trainer's blocking reads into busy
    loops. An empty read now reports "nothing yet" (None), so the read blocks until an entry
    arrives or the timeout passes, as on a real server. Patched in this process only: the
    embedded server runs here."""
    from fakeredis.commands_mixins.streams_mixin import StreamsCommandsMixin

    if getattr(StreamsCommandsMixin, "_retool_block_patch", False):
        return
    original = StreamsCommandsMixin._xreadgroup

    def _xreadgroup(self: Any, *args: Any) -> Any:
        return original(self, *args) or None

    StreamsCommandsMixin._xreadgroup = _xreadgroup  # type: ignore[method-assign]
    StreamsCommandsMixin._retool_block_patch = True  # type: ignore[attr-defined]


class PrivateRedis:
    def __init__(self, data_dir: str | Path, backend: Backend = "auto", port: int | None = None,
                 appendonly: bool = False) -> None:
        """``appendonly`` (redis-server only): fsync every write to an AOF in ``data_dir``, so a
        restarted server on the same directory has every acknowledged write (durability tests)."""
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        if backend == "auto":
            backend = "redis-server" if shutil.which("redis-server") else "fakeredis"
        self.backend: str = backend
        self._proc: subprocess.Popen | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        if self.backend == "redis-server":
            binary = shutil.which("redis-server")
            if binary is None:
                raise RuntimeError("queue backend redis-server: no redis-server binary on PATH")
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._proc = subprocess.Popen(
                [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
                 "--save", "", "--daemonize", "no",
                 *(["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly
                   else ["--appendonly", "no"])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        else:
            try:
                from fakeredis import TcpFakeServer
            except ImportError:
                raise RuntimeError("no redis-server on PATH and the fallback package fakeredis is not "
                                   "installed: install one of them (apt install redis-server / "
                                   "pip install fakeredis)") from None
            self._server = TcpFakeServer(("127.0.0.1", self.port), server_type="redis")
            self._server.RequestHandlerClass = _keep_alive_handler()
            _patch_fakeredis_block()
            self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
            self._thread.start()
        self._wait()
        return self

    def _wait(self, timeout_s: float = 20.0) -> None:
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if self._proc is not None and self._proc.poll() is not None:
                        raise RuntimeError(f"redis-server exited with code {self._proc.returncode}") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.backend} did not answer on port {self.port}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def restart(self) -> None:
        """Stop and start again on the same port and data directory (redis-server only)."""
        self.stop()
        self.start()

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
