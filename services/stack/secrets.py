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

Invariants: secrets come from ``secrets.token_urlsafe`` (256 bits); the directory is created 0700
and ``ca.key`` is 0600; the other files are 0644 *inside* that private directory, so the
non-root users of the containers that bind-mount one file can read it while no other host user
can reach it; nothing is printed but the file names; an existing directory is never overwritten
(``--force`` replaces it).
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import shutil
from pathlib import Path

from services.common.security import token_digest
from services.stack.redis_acl import acl_file

SERVER_NAMES = ("redis", "rollout", "sandbox", "reward")
TOKENS = ("weight-token", "rollout-token", "sandbox-token", "reward-token")
REDIS_USERS = ("trainer", "rollout", "health")
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
    from cryptography import x509

    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(common_name: str = "retool private CA", days: int = 825):
    """A self-signed CA: (key, certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

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
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

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


def write_pair(out: Path, stem: str, key, cert) -> None:
    (out / f"{stem}.key").write_bytes(_pem_key(key))
    (out / f"{stem}.crt").write_bytes(_pem_cert(cert))


def init_secrets(out: Path, *, sans: list[str] | None = None, namespace: str = "retool",
                 prompts_stream: str = "retool:prompts", groups_stream: str = "retool:groups",
                 force: bool = False) -> list[str]:
    """Write every secret into ``out``; returns the file names written."""
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    extra = list(sans or [])
    ca_key, ca_cert = make_ca()
    write_pair(out, "ca", ca_key, ca_cert)
    for service in SERVER_NAMES:
        key, cert = issue(ca_key, ca_cert, service, _names(service, namespace, extra))
        write_pair(out, service, key, cert)
    key, cert = issue(ca_key, ca_cert, "trainer", [], client=True)
    write_pair(out, "trainer", key, cert)
    for name in TOKENS:
        token = secrets.token_urlsafe(32)
        (out / name).write_text(token + "\n")
        (out / f"{name}.sha256").write_text(token_digest(token).hex() + "\n")
    passwords = {user: secrets.token_urlsafe(32) for user in REDIS_USERS}
    for user, password in passwords.items():
        (out / f"redis-{user}-password").write_text(password + "\n")
    (out / "redis-users.acl").write_text(acl_file(passwords, prompts_stream, groups_stream))
    (out / "grafana-admin-password").write_text(secrets.token_urlsafe(18) + "\n")
    for path in out.iterdir():
        path.chmod(0o600 if path.name == "ca.key" else 0o644)
    return sorted(p.name for p in out.iterdir())
