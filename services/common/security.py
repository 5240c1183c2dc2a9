"""Secrets and TLS settings shared by every service: where a token, password or certificate comes
from, validated before anything starts.

Invariants:
- a secret is never a config *value*: only the path of a file that holds it (``*_file``, what
  Docker/Kubernetes secrets mount) or the NAME of an environment variable (``*_env``); so it never
  appears on a command line, in ``--dry-run`` output or in a log line;
- ``read_secret`` strips surrounding whitespace and refuses an empty or missing file with a
  ``ConfigError`` naming the field; an unset env var is "no secret" (None), and a secret marked
  ``required`` that is absent is a ``ConfigError`` before start (secure defaults refuse to start
  instead of running open);
- TLS file paths are checked to exist when the settings are loaded (a typo fails at start, not at
  the first connection); a client with a key but no certificate (or the reverse) is refused.
"""

from __future__ import annotations

import hashlib
import os
import ssl
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from services.common.config import ConfigError, StrictModel


def read_secret(file: str | None, env: str | None, what: str) -> str | None:
    """The secret in ``file`` (preferred) or in the env var named ``env``; None when neither is set."""
    if file:
        path = Path(file)
        if not path.is_file():
            raise ConfigError(f"{what}: secret file {path} does not exist")
        value = path.read_text().strip()
        if not value:
            raise ConfigError(f"{what}: secret file {path} is empty")
        return value
    if env:
        return os.environ.get(env, "").strip() or None
    return None


def _existing(path: str | None, what: str) -> str | None:
    if path is not None and not Path(path).is_file():
        raise ValueError(f"{what}: file {path} does not exist")
    return path


class SecretRef(StrictModel):
    """Where one secret (a bearer token, a password) is read from."""

    file: str | None = Field(None, description="file holding the secret (a mounted Docker/Kubernetes secret)")
    env: str | None = Field(None, description="NAME of an environment variable holding the secret")

    def read(self, what: str) -> str | None:
        return read_secret(self.file, self.env, what)


class TLSServerFiles(StrictModel):
    """A server's certificate and key; ``client_ca_file`` set = clients must present a certificate
    signed by that CA (mutual TLS)."""

    cert_file: str = Field(..., description="PEM certificate chain of this server")
    key_file: str = Field(..., description="PEM private key of this server")
    client_ca_file: str | None = Field(None, description="require client certificates signed by this CA")

    @model_validator(mode="after")
    def _files(self) -> TLSServerFiles:
        _existing(self.cert_file, "cert_file")
        _existing(self.key_file, "key_file")
        _existing(self.client_ca_file, "client_ca_file")
        return self

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes(), ca


class TLSClientFiles(StrictModel):
    """How a client checks the server (``ca_file``) and, for mutual TLS, proves who it is."""

    ca_file: str = Field(..., description="PEM CA bundle that signed the server's certificate")
    cert_file: str | None = Field(None, description="client certificate (mutual TLS)")
    key_file: str | None = Field(None, description="client private key (mutual TLS)")
    server_name: str | None = Field(
        None, description="name to check the server certificate against instead of the host dialled "
        "(e.g. 'rollout' when dns: discovery dials pod or container IPs)")

    @model_validator(mode="after")
    def _files(self) -> TLSClientFiles:
        _existing(self.ca_file, "ca_file")
        _existing(self.cert_file, "cert_file")
        _existing(self.key_file, "key_file")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file: give both (mutual TLS) or neither")
        return self

    def ssl_context(self) -> ssl.SSLContext:
        """A verifying client context (hostname checked unless ``server_name`` overrides it by SNI)."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def token_digest(token: str) -> bytes:
    """What a server keeps of a bearer token: its SHA-256 (a 256-bit random token cannot be recovered
    from it, so a file holding it may sit where untrusted code can read it: the sandbox)."""
    return hashlib.sha256(token.encode()).digest()


class ServerSecurity(StrictModel):
    """An HTTP service's door: a bearer token and/or TLS. ``/healthz`` and ``/metrics`` stay open
    (probes and scrapers; they carry no secrets), every other route needs the token when one is set."""

    token: SecretRef = Field(default_factory=SecretRef, description="bearer token clients must send")
    token_sha256: SecretRef = Field(
        default_factory=SecretRef, description="instead of token: the hex SHA-256 of the token (what "
        "`retool secrets init` writes as <name>-token.sha256), for a server whose files untrusted code "
        "can read")
    require_token: bool = Field(
        False, description="refuse to start without a token (the multi-machine and Kubernetes defaults)")
    tls: TLSServerFiles | None = Field(None, description="serve HTTPS with this certificate")

    def read_digest(self, what: str) -> bytes | None:
        """SHA-256 of the token clients must send; None = no door (refused when ``require_token``)."""
        token = self.token.read(f"{what}.token")
        hexed = self.token_sha256.read(f"{what}.token_sha256")
        if token is not None and hexed is not None:
            raise ConfigError(f"{what}: set token or token_sha256, not both")
        if hexed is not None:
            try:
                digest = bytes.fromhex(hexed)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ConfigError(f"{what}.token_sha256: expected 64 hex characters (a SHA-256)")
            return digest
        if token is None:
            if self.require_token:
                raise ConfigError(f"{what}.require_token: no bearer token configured ({what}.token.file, "
                                  f"{what}.token.env or {what}.token_sha256.file): refusing to serve "
                                  "without authentication")
            return None
        return token_digest(token)


    def uvicorn_kwargs(self) -> dict[str, Any]:
        """``uvicorn.run`` TLS arguments (none without ``tls``)."""
        if self.tls is None:
            return {}
        kwargs: dict[str, Any] = {"ssl_certfile": self.tls.cert_file, "ssl_keyfile": self.tls.key_file}
        if self.tls.client_ca_file:
            kwargs.update(ssl_ca_certs=self.tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return kwargs


class ClientSecurity(StrictModel):
    """How a client reaches a secured service: the bearer token it sends and the TLS it checks."""

    token: SecretRef = Field(default_factory=SecretRef, description="bearer token sent as Authorization")
    tls: TLSClientFiles | None = Field(None, description="verify the server's certificate with this CA")

    def headers(self, what: str) -> dict[str, str]:
        token = self.token.read(f"{what}.token")
        return {"Authorization": f"Bearer {token}"} if token else {}

    def verify(self) -> ssl.SSLContext | bool:
        """For httpx ``verify=``: the CA context when TLS is configured, else the default (True)."""
        return self.tls.ssl_context() if self.tls is not None else True

    def httpx_kwargs(self, what: str) -> dict[str, Any]:
        """``headers``, ``verify`` and (with ``tls.server_name``) a request hook that checks the
        server's certificate against that name whatever address is dialled, for an
        ``httpx.AsyncClient``."""
        kwargs: dict[str, Any] = {"headers": self.headers(what), "verify": self.verify()}
        if self.tls is not None and self.tls.server_name:
            name = self.tls.server_name

            async def _server_name(request: Any) -> None:
                request.extensions["sni_hostname"] = name

            kwargs["event_hooks"] = {"request": [_server_name]}
        return kwargs
