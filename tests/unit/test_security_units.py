"""The security settings and the bearer door in isolation: what is accepted, what is refused, and the
config errors that stop a service before it serves (the same doors against real servers:
tests/integration/test_secure_links.py)."""

from __future__ import annotations

import hashlib

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from services.common.config import ConfigError
from services.common.http_auth import bearer_ok, protect
from services.common.metrics import MetricsRegistry, add_observability_routes
from services.common.queue import RedisAuth
from services.common.security import ClientSecurity, SecretRef, ServerSecurity, TLSClientFiles, token_digest
from services.stack.redis_acl import acl_file
from services.trainer.loop import RunConfig

TOKEN = "s3cret-token"
DIGEST = hashlib.sha256(TOKEN.encode()).digest()


@pytest.mark.parametrize(("header", "ok"), [
    (f"Bearer {TOKEN}", True), (f"bearer {TOKEN}", True), (f"Bearer  {TOKEN} ", True),
    ("Bearer wrong", False), (f"Basic {TOKEN}", False), (f"Bearer {TOKEN}x", False), ("", False),
    (TOKEN, False),
])
def test_bearer_header_must_carry_exactly_the_token(header: str, ok: bool) -> None:
    assert bearer_ok([(b"authorization", header.encode())], DIGEST) is ok
    assert bearer_ok([(b"Authorization", header.encode())], DIGEST) is ok


def test_no_authorization_header_is_refused() -> None:
    assert not bearer_ok([(b"x-token", TOKEN.encode())], DIGEST)


def _app(tmp_path, **security) -> tuple[FastAPI, MetricsRegistry]:
    app = FastAPI()
    registry = MetricsRegistry("t")
    add_observability_routes(app, registry, lambda: {"status": "ok"})

    @app.post("/work")
    def work() -> dict[str, str]:
        return {"done": "yes"}

    protect(app, ServerSecurity.model_validate(security), registry)
    return app, registry


async def _post(app: FastAPI, path: str, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, headers=headers) if path == "/work" else await c.get(path, headers=headers)


async def test_the_door_guards_every_route_but_health_and_metrics(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    app, registry = _app(tmp_path, token={"file": str(token_file)})
    assert (await _post(app, "/work", {"Authorization": f"Bearer {TOKEN}"})).json() == {"done": "yes"}
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = await _post(app, "/work", headers)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert TOKEN not in r.text
    assert (await _post(app, "/healthz", {})).status_code == 200
    assert (await _post(app, "/metrics", {})).status_code == 200
    assert b"t_unauthorized_requests_total 2.0" in registry.render()


async def test_a_server_may_hold_only_the_hash_of_its_token(tmp_path) -> None:
    hashed = tmp_path / "token.sha256"
    hashed.write_text(token_digest(TOKEN).hex() + "\n")
    app, _ = _app(tmp_path, token_sha256={"file": str(hashed)})
    assert (await _post(app, "/work", {"Authorization": f"Bearer {TOKEN}"})).status_code == 200
    hash_as_token = {"Authorization": f"Bearer {token_digest(TOKEN).hex()}"}
    assert (await _post(app, "/work", hash_as_token)).status_code == 401


async def test_without_a_token_there_is_no_door(tmp_path) -> None:
    app, _ = _app(tmp_path)
    assert (await _post(app, "/work", {})).status_code == 200


def test_security_config_errors_name_the_field(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("RETOOL_UNSET_FOR_TEST", raising=False)
    with pytest.raises(ConfigError, match="require_token"):
        ServerSecurity(require_token=True, token=SecretRef(env="RETOOL_UNSET_FOR_TEST")).read_digest("s")
    bad = tmp_path / "bad.sha256"
    bad.write_text("not-hex")
    with pytest.raises(ConfigError, match="token_sha256: expected 64 hex"):
        ServerSecurity(token_sha256=SecretRef(file=str(bad))).read_digest("security")
    both = tmp_path / "t"
    both.write_text("x")
    with pytest.raises(ConfigError, match="not both"):
        ServerSecurity(token=SecretRef(file=str(both)),
                       token_sha256=SecretRef(file=str(both))).read_digest("s")
    with pytest.raises(ConfigError, match="does not exist"):
        SecretRef(file=str(tmp_path / "missing")).read("x")
    monkeypatch.setenv("RETOOL_SET_FOR_TEST", " tok \n")
    client = ClientSecurity(token=SecretRef(env="RETOOL_SET_FOR_TEST"))
    assert client.headers("c") == {"Authorization": "Bearer tok"}
    assert ClientSecurity().headers("c") == {}


def test_tls_files_are_checked_at_load(tmp_path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    with pytest.raises(ValidationError, match="does not exist"):
        TLSClientFiles(ca_file=str(tmp_path / "nope.crt"))
    with pytest.raises(ValidationError, match="give both"):
        TLSClientFiles(ca_file=str(ca), cert_file=str(ca))
    with pytest.raises(ValidationError, match="server_name: not supported for Redis"):
        RedisAuth(tls={"ca_file": str(ca), "server_name": "redis"})


def test_acl_names_every_user_and_refuses_glob_stream_names() -> None:
    text = acl_file({"trainer": "a", "rollout": "b", "health": "c"})
    lines = {line.split()[1]: line for line in text.splitlines()}
    assert lines["default"].startswith("user default off")
    assert hashlib.sha256(b"a").hexdigest() in lines["trainer"] and " a " not in lines["trainer"]
    assert "(~retool:prompts* +xadd" in lines["trainer"] and "+xadd" not in lines["rollout"].split(")")[0]
    with pytest.raises(ValueError, match="missing"):
        acl_file({"trainer": "a"})
    with pytest.raises(ValueError, match="glob"):
        acl_file({"trainer": "a", "rollout": "b", "health": "c"}, prompts="retool:*")


def test_collective_timeout_must_outlast_the_longest_legitimate_wait() -> None:
    base = {"dataset": "d.parquet", "group_wait_s": 100, "weight_push_wait_s": 50}
    with pytest.raises(ValidationError, match="must exceed group_wait_s"):
        RunConfig.model_validate({**base, "trainer": {"fsdp": {"timeout_s": 120}}})
    ok = RunConfig.model_validate({**base, "trainer": {"fsdp": {"timeout_s": 200}}})
    assert ok.trainer.fsdp.timeout_s == 200
