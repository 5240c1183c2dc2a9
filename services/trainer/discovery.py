"""Rollout replica discovery: turn configured ``rollout_targets`` / ``rollout_urls`` into addresses.

Invariants:
- a static entry (``host:port`` or ``http://host:port``) is returned unchanged;
- a ``dns:`` entry (``dns:rollout:50051`` or ``dns:http://rollout:8000``) expands to one address
  per IP its host resolves to *now* (compose's service DNS returns one A record per replica of a
  ``--scale``-d service), sorted and de-duplicated, so calling this every step follows scale-up
  and scale-down;
- a ``dns:`` entry that resolves to nothing, or an entry without a port, is an error naming the
  entry (a push to zero replicas must not pass silently);
- ``check_entry`` validates the syntax when the run config is loaded, before anything resolves.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

Resolver = Callable[[str], Iterable[str]]
DNS_PREFIX = "dns:"


class DiscoveryError(RuntimeError):
    pass


def system_resolver(host: str) -> list[str]:
    """Every IPv4/IPv6 address ``host`` resolves to (getaddrinfo: /etc/hosts, Docker's DNS, ...)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DiscoveryError(f"cannot resolve {host!r}: {exc}") from None
    return [str(info[4][0]) for info in infos]


def _fmt(ip: str) -> str:
    return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip


def check_entry(entry: str, *, url: bool) -> str:
    """Syntax of one configured entry, without resolving it (config validation).

    ``url=False`` (gRPC targets): ``host:port`` or ``dns:host:port``; ``url=True`` (HTTP):
    ``http(s)://host[:port]`` or ``dns:http(s)://host:port``. Returns ``entry``; raises
    ``ValueError`` naming it and the expected form.
    """
    dns = entry.startswith(DNS_PREFIX)
    rest = entry[len(DNS_PREFIX) :] if dns else entry
    want = "dns:http://HOST:PORT or http://HOST[:PORT]" if url else "dns:HOST:PORT or HOST:PORT"
    try:
        parts = urlsplit(rest if url else f"grpc://{rest}")
        port = parts.port
    except ValueError:
        raise ValueError(f"{entry!r}: bad port; expected {want}") from None
    if url and parts.scheme not in ("http", "https"):
        raise ValueError(f"{entry!r}: expected {want}")
    if not parts.hostname or ((dns or not url) and port is None) or (not url and parts.path):
        raise ValueError(f"{entry!r}: expected {want}")
    return entry


def _expand(entry: str, resolver: Resolver) -> list[str]:
    rest = entry[len(DNS_PREFIX) :]
    url = urlsplit(rest if "://" in rest else f"grpc://{rest}")
    if not url.hostname or url.port is None:
        raise DiscoveryError(f"{entry!r}: expected dns:HOST:PORT or dns:SCHEME://HOST:PORT")
    try:
        ips = sorted({ip for ip in resolver(url.hostname)}, key=lambda ip: ipaddress.ip_address(ip).packed)
    except DiscoveryError:
        raise
    except Exception as exc:
        raise DiscoveryError(f"{entry!r}: resolving {url.hostname!r} failed: {exc}") from None
    if not ips:
        raise DiscoveryError(f"{entry!r}: {url.hostname!r} resolves to no address")
    hosts = [f"{_fmt(ip)}:{url.port}" for ip in ips]
    if "://" in rest:
        tail = url.path + (f"?{url.query}" if url.query else "")
        return [f"{url.scheme}://{h}{tail}" for h in hosts]
    return hosts


def resolve(entries: Iterable[str], resolver: Resolver = system_resolver) -> list[str]:
    """Expand every ``dns:`` entry; keep static entries; order kept, duplicates dropped."""
    out: list[str] = []
    for entry in entries:
        expanded = _expand(entry, resolver) if entry.startswith(DNS_PREFIX) else [entry]
        out.extend(a for a in expanded if a not in out)
    return out
