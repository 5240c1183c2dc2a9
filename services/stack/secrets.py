"""``retool secrets init``: every secret a deployment across machines needs, minted locally.

Writes into one directory (the compose override and the Kubernetes Secrets read these names):
- ``ca.crt`` / ``ca.key``: a private CA (keep ``ca.key`` offline; nothing mounts it);
- ``redis.crt/.key``, ``rollout.crt/.key``, ``sandbox.crt/.key``, ``reward.crt/.key``: server
  certificates (serverAuth) for the compose names, the Kubernetes names in ``namespace`` and every
  ``--san`` (node addresses, DNS names), plus ``localhost`` / ``127.0.0.1`` for health checks;
- ``trainer.crt/.key``: the trainer's client certificate (clientAuth) for the mutual-TLS push;
- ``weight-token``, ``rollout-token``, ``sandbox-token``, ``reward-token``: bearer tokens, and
  ``<name>.sha256`` beside each: what a server may hold instead (the sandbox does: model-written
  code can read its container's files, and the hash does not authenticate anyone);
- ``redis-trainer-password``, ``redis-rollout-password``, ``redis-health-password`` and
  ``redis-users.acl``: the Redis ACL with those users' SHA-256 password hashes (never the
  passwords) and least privilege on the streams (``redis_acl``);
- ``grafana-admin-password`` (Kubernetes: the retool-grafana Secret).

Invariants: secrets come from ``secrets.token_urlsafe`` (256 bits); the directory is created 0700;
every file is created 0600 and then given its mode, so no secret is ever readable by others, even
for an instant and even once copied out of the directory:
- ``ca.key``: 0600 (mounted nowhere);
- the other private keys, tokens, passwords and the ACL (``SECRET_MODE``): 0640, group = the
  caller's primary group or ``group``. Compose bind-mounts each file with its host owner and mode,
  so the containers that mount one get that group (``group_add: [${RETOOL_SECRETS_GID}]`` in
  deploy/docker-compose.multinode.yml); Kubernetes Secret volumes set their own modes
  (``defaultMode: 0440`` with the pod's ``fsGroup``), whatever the files' modes here;
- certificates and the ``.sha256`` digests (``PUBLIC_MODE``): 0644, nothing secret in them (the
  sandbox, root without capabilities in its container, reads its digest through the "other" bits).
Nothing is printed but the file names; an existing directory is never overwritten (``--force``
replaces it).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import shutil
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.security import token_digest
from services.stack.redis_acl import acl_file

SERVER_NAMES = ("redis", "rollout", "sandbox", "reward")
TOKENS = ("weight-token", "rollout-token", "sandbox-token", "reward-token")
REDIS_USERS = ("trainer", "rollout", "health")
SECRET_MODE, PUBLIC_MODE, CA_KEY_MODE = 0o640, 0o644, 0o600
# compose aliases of each server (the CPU variant answers to the same name as the GPU one)
ALIASES = {"rollout": ("rollout-cpu",)}


def _names(service: str, namespace: str, extra: list[str]) -> list[str]:
    names = [service, *ALIASES.get(service, ())]
    for n in (service, *ALIASES.get(service, ())):
        names += [f"{n}.{namespace}", f"{n}.{namespace}.svc", f"{n}.{namespace}.svc.cluster.local"]
    # pods behind a headless Service: <pod>.<service>.<namespace>.svc...
    names += [f"*.{service}.{namespace}.svc", f"*.{service}.{namespace}.svc.cluster.local"]
    return [*names, "localhost", "127.0.0.1", *extra]


def _san(names: list[str]):  # -> x509.SubjectAlternativeName

    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(common_name: str = "retool private CA", days: int = 825):
    """A self-signed CA: (key, certificate)."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key, ca_cert, common_name: str, names: list[str], *, client: bool = False, days: int = 825):
    """A leaf certificate signed by the CA: (key, certificate); ``client`` = clientAuth, else serverAuth."""
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def is_public(name: str) -> bool:
    """Certificates and token digests: no secret in them."""
    return name.endswith((".crt", ".sha256"))


def mode_of(name: str) -> int:
    return CA_KEY_MODE if name == "ca.key" else PUBLIC_MODE if is_public(name) else SECRET_MODE


def _write(path: Path, data: bytes, group: int | None) -> None:
    """Create ``path`` 0600 (never wider, not even before its chmod), then give it its mode/group."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
        fh.write(data)
        if group is not None and path.name != "ca.key":
            try:
                os.fchown(fh.fileno(), -1, group)
            except PermissionError:
                raise PermissionError(f"cannot give {path} group {group}: run as a member of that group "
                                      "(or root), or leave --group out") from None
        os.fchmod(fh.fileno(), mode_of(path.name))


def write_pair(out: Path, stem: str, key, cert, group: int | None = None) -> None:
    _write(out / f"{stem}.key", _pem_key(key), group)
    _write(out / f"{stem}.crt", _pem_cert(cert), group)


def init_secrets(out: Path, *, sans: list[str] | None = None, namespace: str = "retool",
                 prompts_stream: str = "retool:prompts", groups_stream: str = "retool:groups",
                 force: bool = False, group: int | None = None) -> list[str]:
    """Write every secret into ``out``; returns the file names written. ``group``: the gid the
    group-readable secrets get (default: the caller's primary group)."""
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    extra = list(sans or [])
    ca_key, ca_cert = make_ca()
    write_pair(out, "ca", ca_key, ca_cert, group)
    for service in SERVER_NAMES:
        key, cert = issue(ca_key, ca_cert, service, _names(service, namespace, extra))
        write_pair(out, service, key, cert, group)
    key, cert = issue(ca_key, ca_cert, "trainer", [], client=True)
    write_pair(out, "trainer", key, cert, group)
    for name in TOKENS:
        token = secrets.token_urlsafe(32)
        _write(out / name, (token + "\n").encode(), group)
        _write(out / f"{name}.sha256", (token_digest(token).hex() + "\n").encode(), group)
    passwords = {user: secrets.token_urlsafe(32) for user in REDIS_USERS}
    for user, password in passwords.items():
        _write(out / f"redis-{user}-password", (password + "\n").encode(), group)
    _write(out / "redis-users.acl", acl_file(passwords, prompts_stream, groups_stream).encode(), group)
    _write(out / "grafana-admin-password", (secrets.token_urlsafe(18) + "\n").encode(), group)
    return sorted(p.name for p in out.iterdir())
