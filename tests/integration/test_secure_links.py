"""Every door that can cross a machine, secured and attacked, on loopback with real servers.

A throwaway PKI is minted by the product's own ``retool secrets init`` code, plus a rogue CA (what
an attacker on the network holds). Then, each against the real server:
- Redis (a real redis-server: TLS port only, the generated ACL): the trainer and rollout users do
  every stream operation their code does (the real rollout worker runs a job through it), and each
  is refused what belongs to the other role; no password, a wrong one, plain text, a server
  certificate from another CA and a client certificate from another CA are all refused;
- the gRPC weight push over mutual TLS: a push with the trainer's certificate and the token lands; a
  plain-text channel, TLS without a client certificate, a rogue client certificate, a rogue CA and a
  wrong token are refused, and the served weights stay those of the last good push;
- HTTP: the rollout app over HTTPS with a bearer token (its ``/v1/rollouts`` runs a tool call through
  a real sandbox and a real reward service, both requiring their own tokens); ``/v1/chat/completions``,
  ``/run_code`` and ``/score`` refuse a missing or wrong token with 401 while ``/healthz`` stays open;
  plain HTTP to the HTTPS port and a client trusting another CA fail; refusals are counted.
The same doors under Docker, across containers, are tests/deploy/test_multinode_secure.py.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.exceptions as rexc

from services.common.config import ConfigError
from services.common.process import ServiceProcess
from services.common.queue import CONNECTION_ERROR_HOOKS, RedisAuth, RedisStream, connect, publish_and_ack
from services.common.schemas import ChatMessage, Group, PromptJob
from services.common.security import SecretRef, ServerSecurity, TLSClientFiles, TLSServerFiles
from services.rollout.agent.loop import AgentLoop
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import AgentConfig, RedisWorkerConfig, RolloutConfig
from services.rollout.engine.hf import HFEngine
from services.rollout.server import create_app
from services.rollout.weights.server import start_weight_server
from services.rollout.worker import RolloutWorker
from services.sandbox.launcher import SandboxProcess
from services.trainer.observability import queue_stats
from services.transport.reward.client import RewardClient
from services.transport.sandbox.client import SandboxClient
from services.transport.weights.client import WeightPushError, iter_checkpoint, push_state_dict_async
from services.transport.weights.tls import ChannelSecurity
from tests.helpers.agent_fixtures import ScriptedEngine, make_tokenizer
from tests.helpers.secure import PKI, SecureRedis, mint
from tests.helpers.tiny_model import tiny_model_dir
from tests.helpers.uvicorn_app import serving

pytestmark = pytest.mark.integration
TOK = make_tokenizer()
PROMPTS, GROUPS = "retool:prompts", "retool:groups"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return mint(tmp_path_factory.mktemp("pki") / "secrets")


@pytest.fixture
def secure_redis(pki: PKI, tmp_path: Path) -> Iterator[SecureRedis]:
    with SecureRedis(pki, tmp_path / "redis") as server:
        yield server


def _auth(pki: PKI, user: str | None, *, password: str | None = None, ca: str = "ca.crt",
          cert: str | None = None) -> RedisAuth:
    secret = f"redis-{user}-password" if user and password is None else None
    pw = SecretRef(file=pki.path(secret)) if secret else SecretRef()
    if password is not None:
        (pki.dir / "given-password").write_text(password)
        pw = SecretRef(file=pki.path("given-password"))
    tls = TLSClientFiles(ca_file=pki.path(ca), cert_file=pki.path(f"{cert}.crt") if cert else None,
                         key_file=pki.path(f"{cert}.key") if cert else None)
    return RedisAuth(username=user, password=pw, tls=tls)


# ---- Redis --------------------------------------------------------------------------------------


async def test_redis_roles_get_what_their_code_needs_and_nothing_of_the_other_role(secure_redis, pki,
                                                                                  sandbox_url) -> None:
    # a plain redis:// URL: the TLS settings upgrade it (never plain text once TLS is configured)
    url = secure_redis.url.replace("rediss://", "redis://")
    trainer, rollout = connect(url, _auth(pki, "trainer")), connect(url, _auth(pki, "rollout"))
    try:
        t_prompts, t_groups = RedisStream(trainer, PROMPTS), RedisStream(trainer, GROUPS, "trainer")
        await t_groups.ensure_group()
        job = PromptJob(messages=[ChatMessage(role="user", content="What is 2+2?")], ground_truth="4", n=2,
                        policy_version=0)
        await t_prompts.add(job.to_msgpack())
        # the real rollout worker (rollout user) runs the job: read, heartbeat, sandbox, publish+ack
        engine = ScriptedEngine(TOK, {0: ["<code>print(2 + 2)</code>", "<answer>\\boxed{4}</answer>"],
                                      1: ["<answer>\\boxed{5}</answer>"]}, version=0)
        sandbox = SandboxTool(SandboxClient(sandbox_url))
        agent = AgentLoop(engine, TOK, sandbox, AgentConfig())
        wcfg = RedisWorkerConfig(url="unused", consumer="w1", block_ms=100, claim_idle_ms=500,
                                 heartbeat_ms=100)
        worker = RolloutWorker(agent, RedisStream(rollout, PROMPTS, "rollout"), RedisStream(rollout, GROUPS),
                               wcfg)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        deadline = time.monotonic() + 60
        while await t_groups.depth() < 1:
            assert not task.done(), task.exception()
            assert time.monotonic() < deadline, "the worker wrote no group"
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 30)
        await sandbox.aclose()
        assert worker.stats.jobs_done == 1
        # the trainer side: read, touch, claim, stats, ack+delete
        (msg,) = await t_groups.read("trainer-0", count=1, block_ms=1000)
        assert Group.from_msgpack(msg.data).job_id == job.job_id
        await t_groups.touch("trainer-0", [msg.id])
        assert [m.id for m in await t_groups.claim_stale("trainer-0", min_idle_ms=0)] == [msg.id]
        stats = await queue_stats(t_prompts, t_groups)
        assert stats["queue/groups_pending"] == 1.0 and stats["queue/prompts_depth"] == 0.0
        assert await t_groups.ack(msg.id, delete=True) == 1
        # the rollout side's other paths: claim, touch, publish_and_ack, dead letters, its stats
        r_prompts = RedisStream(rollout, PROMPTS, "rollout")
        await t_prompts.add(b"job-2")
        (m2,) = await r_prompts.read("w1", count=1, block_ms=1000)
        await r_prompts.touch("w1", [m2.id])
        assert [m.id for m in await r_prompts.claim_stale("w2", min_idle_ms=0)] == [m2.id]
        assert await r_prompts.backlog() == 1
        await RedisStream(rollout, f"{PROMPTS}:dead").add(b"bad", extra={"reason": "test"})
        await publish_and_ack(RedisStream(rollout, GROUPS), b"group-2", r_prompts, [m2.id])
        # the trainer's recovery paths: the one-snapshot scan for vanished jobs, the dead letters
        from services.trainer.feed import DeadLetters, PromptFeeder
        from services.trainer.staleness import StalenessManager

        feeder = PromptFeeder(t_prompts, [job], StalenessManager(1, 0))
        feeder.outstanding = {0}
        assert await feeder.vanished(GROUPS, f"{PROMPTS}:dead") == [f"{job.job_id}:0"]
        t_dead = RedisStream(trainer, f"{PROMPTS}:dead", "trainer")
        await t_dead.ensure_group()
        letters = DeadLetters(t_dead, "trainer-0")
        assert await letters.read() == [(None, "test")]  # b"bad" holds no job id
        assert await letters.commit() == 1

        # least privilege: each role is refused the other's writes, other keys and admin commands
        for call in (RedisStream(rollout, PROMPTS).add(b"forged prompt"),
                     RedisStream(trainer, GROUPS).add(b"forged group"),
                     RedisStream(trainer, "other:stream").add(b"x"),
                     trainer.set("retool:prompts:x", "v"), rollout.get(GROUPS),
                     # turn checkpoints: the rollout's hashes only, and only for the rollout
                     trainer.hset(f"{PROMPTS}:ckpt:j", "m0", "x"), rollout.hset(f"{PROMPTS}:x", "m0", "x"),
                     rollout.hset(f"{GROUPS}:ckpt:j", "m0", "x")):
            with pytest.raises(rexc.NoPermissionError):
                await call
        for call in (trainer.flushall(), rollout.config_get("*"), trainer.keys("*"),
                     rollout.eval("return 1", 0), trainer.acl_list()):
            with pytest.raises(rexc.NoPermissionError):
                await call
        assert await RedisStream(trainer, GROUPS, "trainer").depth() == 1  # nothing forged landed
    finally:
        await trainer.aclose()
        await rollout.aclose()


async def _xadd(url: str, auth: RedisAuth | None) -> Any:
    # one retry, not the 12 (about 40 s) a service rides out a Redis restart with: a refusal looks like
    # a dropped connection to the client, so it is raised only once the retries are spent; one retry
    # still shows it is not a passing fault, and each refusal costs about a second instead of 45 s
    client = connect(url, auth, retries=1)
    try:
        return await client.xadd(PROMPTS, {b"d": b"forged"})
    finally:
        await client.aclose()


@pytest.fixture
def failed_attempts() -> Iterator[list[int]]:
    """How many Redis commands failed on a dropped or refused connection (each attempt counts)."""
    seen = [0]

    def count() -> None:
        seen[0] += 1

    CONNECTION_ERROR_HOOKS.append(count)
    try:
        yield seen
    finally:
        CONNECTION_ERROR_HOOKS.remove(count)


async def test_redis_refuses_unauthenticated_and_wrong_certificate_clients(secure_redis, pki,
                                                                          failed_attempts) -> None:
    url = secure_redis.url
    no_auth = "NOAUTH|must be called with the client already authenticated"
    with pytest.raises((rexc.AuthenticationError, rexc.ResponseError), match=no_auth):
        await _xadd(url, _auth(pki, None))  # TLS, but no user
    with pytest.raises(rexc.AuthenticationError, match="WRONGPASS|invalid username-password"):
        await _xadd(url, _auth(pki, "trainer", password="guessed"))
    with pytest.raises(rexc.ConnectionError):  # plain text to the TLS-only port
        await _xadd(url.replace("rediss://", "redis://"), None)
    with pytest.raises(rexc.ConnectionError, match="certificate verify failed"):  # the server is not ours
        await _xadd(url, _auth(pki, "trainer", ca="rogue-ca.crt"))
    with pytest.raises(rexc.ConnectionError):  # a client certificate signed by another CA
        await _xadd(url, _auth(pki, "trainer", cert="rogue-client"))
    with pytest.raises(ConfigError, match="no credentials in the URL"):
        connect(url.replace("rediss://", "rediss://trainer:pw@"), _auth(pki, "trainer"))
    assert failed_attempts[0] == 5 * 2  # each of the five clients was refused again on its retry
    # the right user still gets in
    assert await _xadd(url, _auth(pki, "trainer"))
    assert failed_attempts[0] == 5 * 2


# ---- gRPC weight push ---------------------------------------------------------------------------

TOKEN = "weight-token-secure-links"


def _channel(pki: PKI, *, ca: str = "ca.crt", cert: str | None = "trainer") -> ChannelSecurity:
    files = TLSClientFiles(ca_file=pki.path(ca), cert_file=pki.path(f"{cert}.crt") if cert else None,
                           key_file=pki.path(f"{cert}.key") if cert else None, server_name="rollout")
    security = ChannelSecurity.from_files(files)
    assert security is not None
    return security


async def test_weight_push_over_mutual_tls_and_every_other_client_refused(pki, tmp_path_factory) -> None:
    model = tiny_model_dir(tmp_path_factory)
    engine = HFEngine(model)
    tls = TLSServerFiles(cert_file=pki.path("rollout.crt"), key_file=pki.path("rollout.key"),
                         client_ca_file=pki.path("ca.crt"))
    server = await start_weight_server(engine, "127.0.0.1", 0, TOKEN, tls=tls)
    target = f"127.0.0.1:{server.port}"
    weights = list(iter_checkpoint(model))
    try:
        report = await push_state_dict_async(weights, [target], 7, TOKEN, security=_channel(pki))
        assert report.replies[target]["version"] == 7 and engine.version == 7
        refused = {
            "plain text": (None, TOKEN),
            "TLS without a client certificate": (_channel(pki, cert=None), TOKEN),
            "a client certificate from another CA": (_channel(pki, cert="rogue-client"), TOKEN),
            "a server it cannot verify": (_channel(pki, ca="rogue-ca.crt"), TOKEN),
            "a wrong token": (_channel(pki), "guessed-token"),
        }
        for what, (security, token) in refused.items():
            with pytest.raises(WeightPushError) as err:
                await push_state_dict_async(weights, [target], 8, token, security=security, timeout_s=20)
            outcome = err.value.results[target]
            want = "UNAUTHENTICATED" if token != TOKEN else "UNAVAILABLE"
            assert outcome.startswith(want), (what, outcome)
            assert engine.version == 7, what  # the served weights are those of the last good push
        # the operator's manual push (`retool rollout push-weights`) over the same mutual TLS
        token_file = pki.dir / "cli-weight-token"
        token_file.write_text(TOKEN)
        cli = [sys.executable, "-m", "services.cli", "rollout", "push-weights", "--checkpoint", str(model),
               "--target", target, "--version", "9", "--token-file", str(token_file)]
        tls_args = ["--ca-file", pki.path("ca.crt"), "--cert-file", pki.path("trainer.crt"),
                    "--key-file", pki.path("trainer.key"), "--server-name", "rollout"]
        for args, want_rc in ((cli, 1), (cli + tls_args, 0)):  # plain text refused; TLS lands
            proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 300)
            assert proc.returncode == want_rc, (args[-1], out.decode()[-500:], err.decode()[-1500:])
            assert TOKEN not in out.decode() + err.decode()
        assert engine.version == 9
    finally:
        await server.stop(None)
        server.servicer.close()
        await engine.shutdown()


# ---- HTTP: rollout (HTTPS + token), sandbox and reward (tokens) ---------------------------------


@pytest.fixture(scope="module")
def tokens(pki: PKI) -> dict[str, str]:
    return {name: pki.secret(f"{name}-token") for name in ("rollout", "sandbox", "reward")}


@pytest.fixture(scope="module")
def secure_sandbox(pki: PKI, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("secure-sandbox") / "sandbox.log"
    args = ["--set", "max_concurrency=4", "--set", "zygotes=1", "--set", "light_zygotes=1",
            "--set", "heavy_zygotes=0",
            "--set", f"security.token_sha256.file={pki.path('sandbox-token.sha256')}",
            "--set", "security.require_token=true"]
    with SandboxProcess(args, log_path=str(log)) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def secure_reward(pki: PKI, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("secure-reward") / "reward.log"
    args = ["reward", "serve", "--set", "workers=1", "--set", "security.require_token=true",
            "--set", f"security.token.file={pki.path('reward-token')}"]
    with ServiceProcess(args, log_path=log) as proc:
        yield proc.url


class _ChatScripted(ScriptedEngine):
    """Agent-loop requests (``...-<index>-t<turn>``) follow their sample's script; a chat completion
    (a bare request id) gets script 2."""

    def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        parts = request_id.split("-")
        if len(parts) < 3 or not parts[-2].isdigit():
            request_id = "chat-2-t0"
        return super().generate(prompt_ids, params, request_id)


@pytest.fixture
async def https_rollout(pki, secure_sandbox, secure_reward) -> AsyncIterator[str]:
    """The rollout app on a real uvicorn with HTTPS and a token; it reaches the sandbox and reward with
    theirs."""
    cfg = RolloutConfig.model_validate({
        "sandbox_url": secure_sandbox, "reward_url": secure_reward, "max_n": 4, "model": "scripted",
        "security": {"token": {"file": pki.path("rollout-token")}, "require_token": True,
                     "tls": {"cert_file": pki.path("rollout.crt"), "key_file": pki.path("rollout.key")}},
        "sandbox_security": {"token": {"file": pki.path("sandbox-token")}},
        "reward_security": {"token": {"file": pki.path("reward-token")}},
    })
    engine = _ChatScripted(TOK, {0: ["<code>print(6*7)</code>", "<answer>\\boxed{42}</answer>"],
                                 1: ["<answer>\\boxed{41}</answer>"], 2: ["It is 42."]}, version=3)
    app = create_app(cfg, engine, TOK)
    async with serving(app, scheme="https", **cfg.security.uvicorn_kwargs()) as url:
        yield url


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def test_rollout_over_https_with_tokens_end_to_end_and_each_http_door_refuses_strangers(
        https_rollout, pki, tokens, secure_sandbox, secure_reward) -> None:
    ca = TLSClientFiles(ca_file=pki.path("ca.crt")).ssl_context()
    chat = {"model": "scripted", "messages": [{"role": "user", "content": "What is 6*7?"}],
            "max_tokens": 16}
    async with httpx.AsyncClient(base_url=https_rollout, verify=ca, timeout=60) as c:
        # works: a tool call through the token-guarded sandbox, scored by the token-guarded reward
        body = {"messages": [{"role": "user", "content": "What is 6*7?"}], "ground_truth": "42", "n": 2,
                "max_turns": 2}
        r = await c.post("/v1/rollouts", json=body, headers=_bearer(tokens["rollout"]))
        assert r.status_code == 200, r.text
        trajs = r.json()["trajectories"]
        assert "<interpreter>\n42\n</interpreter>" in trajs[0]["response_text"], trajs[0]
        assert [t["reward"] for t in trajs] == [1.0, -1.0]
        ok = await c.post("/v1/chat/completions", json=chat, headers=_bearer(tokens["rollout"]))
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"].startswith("It is 42."), ok.json()
        # refused: no token, a wrong token, a token of another service, a non-bearer scheme
        for headers in ({}, _bearer("guessed"), _bearer(tokens["sandbox"]),
                        {"Authorization": f"Basic {tokens['rollout']}"}):
            for path, payload in (("/v1/chat/completions", chat), ("/v1/rollouts", body)):
                r = await c.post(path, json=payload, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), (path, r)
                assert tokens["rollout"] not in r.text
        assert (await c.get("/healthz")).status_code == 200  # probes need no token
        metrics = (await c.get("/metrics")).text
        assert "rollout_unauthorized_requests_total 8.0" in metrics, metrics[-2000:]
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port
        async with httpx.AsyncClient(timeout=10) as plain:
            await plain.post(https_rollout.replace("https://", "http://") + "/v1/chat/completions", json=chat,
                             headers=_bearer(tokens["rollout"]))
    rogue = TLSClientFiles(ca_file=pki.path("rogue-ca.crt")).ssl_context()
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        async with httpx.AsyncClient(verify=rogue, timeout=10) as c:
            await c.get(https_rollout + "/healthz")

    # the sandbox's and reward's own doors
    run = {"code": "print(1)", "language": "python"}
    async with httpx.AsyncClient(timeout=60) as c:
        for headers in ({}, _bearer("guessed"), _bearer(tokens["rollout"])):
            assert (await c.post(f"{secure_sandbox}/run_code", json=run, headers=headers)).status_code == 401
            r = await c.post(f"{secure_reward}/score", json={"response": "\\boxed{1}", "ground_truth": "1"},
                             headers=headers)
            assert r.status_code == 401
        r = await c.post(f"{secure_sandbox}/run_code", json=run, headers=_bearer(tokens["sandbox"]))
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "1\n"
        assert (await c.get(f"{secure_sandbox}/healthz")).status_code == 200
        assert (await c.get(f"{secure_reward}/healthz")).status_code == 200
    scorer = RewardClient(secure_reward, client_kwargs={"headers": _bearer(tokens["reward"])})
    assert (await scorer.score("\\boxed{1}", "1")).correct
    await scorer.aclose()


def test_a_required_token_that_is_missing_stops_the_service_before_it_serves(tmp_path) -> None:
    security = ServerSecurity(require_token=True, token=SecretRef(env="RETOOL_TEST_UNSET_TOKEN_VAR"))
    cfg = RolloutConfig(sandbox_url="http://127.0.0.1:9", model="scripted", security=security)
    with pytest.raises(ConfigError, match="require_token: no bearer token configured"):
        create_app(cfg, ScriptedEngine(TOK, {}, version=0), TOK)
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        ServerSecurity(token=SecretRef(file=str(empty))).read_digest("security")
