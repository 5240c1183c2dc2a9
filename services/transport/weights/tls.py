"""TLS for the weight push (gRPC): server credentials for a rollout replica, channel credentials
for the trainer, from the shared ``TLSServerFiles`` / ``TLSClientFiles`` settings.

Invariants:
- a replica with ``TLSServerFiles`` serves only TLS (no plain-text port beside it); with
  ``client_ca_file`` it also requires a client certificate signed by that CA (mutual TLS) and a
  handshake without one, or with one from another CA, fails before any RPC runs;
- the token still travels in the metadata (``auth.py``): TLS keeps it secret on the wire, the token
  says who may push; neither replaces the other;
- ``server_name`` checks the replica's certificate against that name whatever address was dialled
  (``dns:`` discovery dials pod or container IPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from services.common.security import TLSClientFiles, TLSServerFiles


@dataclass(frozen=True)
class ChannelSecurity:
    credentials: grpc.ChannelCredentials
    server_name: str | None = None

    @classmethod
    def from_files(cls, tls: TLSClientFiles | None) -> ChannelSecurity | None:
        if tls is None:
            return None
        with open(tls.ca_file, "rb") as fh:
            ca = fh.read()
        key = cert = None
        if tls.cert_file and tls.key_file:
            with open(tls.key_file, "rb") as fh:
                key = fh.read()
            with open(tls.cert_file, "rb") as fh:
                cert = fh.read()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return cls(creds, tls.server_name)


def open_channel(target: str, security: ChannelSecurity | None,
                 options: tuple[tuple[str, Any], ...] | list[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A plain channel without ``security``, else a TLS one (with the server-name override)."""
    if security is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    opts = list(options)
    if security.server_name:
        opts.append(("grpc.ssl_target_name_override", security.server_name))
    return grpc.aio.secure_channel(target, security.credentials, options=opts)


def server_credentials(tls: TLSServerFiles) -> grpc.ServerCredentials:
    key, cert, client_ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)
