"""Throwaway PKI and a TLS + ACL ``redis-server`` for the secure-links tests.

``mint(dir)`` runs the product's own ``retool secrets init`` code (a private CA, server and client
certificates, tokens, Redis ACL) and adds a *rogue* CA with a client and a server certificate of its
own: what an attacker on the network could present. ``SecureRedis`` starts a real redis-server with
only a TLS port and that ACL, as deploy/docker-compose.multinode.yml runs it.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.process import free_port
from services.stack.secrets import init_secrets, issue, make_ca, write_pair


@dataclass(frozen=True)
class PKI:
    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def secret(self, name: str) -> str:
        return (self.dir / name).read_text().strip()


def mint(out: Path) -> PKI:
    init_secrets(out)
    rogue_key, rogue_ca = make_ca("rogue CA")
    write_pair(out, "rogue-ca", rogue_key, rogue_ca)
    key, cert = issue(rogue_key, rogue_ca, "trainer", [], client=True)
    write_pair(out, "rogue-client", key, cert)
    key, cert = issue(rogue_key, rogue_ca, "redis", ["redis", "rollout", "localhost", "127.0.0.1"])
    write_pair(out, "rogue-server", key, cert)
    return PKI(out)


class SecureRedis:
    """``redis-server`` on 127.0.0.1: TLS port only (no plain port), ``--aclfile``, client certificates
    verified when presented (``--tls-auth-clients optional``)."""

    def __init__(self, pki: PKI, data_dir: Path) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server not found: install the Debian package 'redis-server'")
        self.pki = pki
        self.data_dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def start(self) -> SecureRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        p = self.pki.path
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(self.port),
             "--tls-cert-file", p("redis.crt"), "--tls-key-file", p("redis.key"),
             "--tls-ca-cert-file", p("ca.crt"), "--tls-auth-clients", "optional",
             "--aclfile", p("redis-users.acl"), "--dir", str(self.data_dir), "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._wait()
        return self

    def _wait(self, timeout_s: float = 20.0) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}: {err}")
            client = redis.Redis(port=self.port, ssl=True, ssl_ca_certs=self.pki.path("ca.crt"),
                                 username="health", password=self.pki.secret("redis-health-password"),
                                 socket_timeout=2)
            try:
                if client.ping():
                    return
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"secure redis-server did not answer on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> SecureRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
