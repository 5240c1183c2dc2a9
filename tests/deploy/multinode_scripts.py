"""Scripts the multi-node deployment test runs *inside* its containers (sent on stdin or mounted).

- ``PRODUCER``: plays the rollout side of namespaced stream pairs as the ``rollout`` ACL user over
  TLS: every prompt job gets a scored group drawn from a generator seeded by the job id, so two
  trainer runs that admit the same jobs train on the same batches (the loss comparison);
- ``DOORS``: knocks on every door of the deployment with the wrong credentials (and the right
  ones, as controls) and prints one JSON object: what each attempt got.
"""

from __future__ import annotations

PRODUCER = r'''
import asyncio, hashlib, random, sys
from services.common.queue import RedisAuth, RedisStream, connect, publish_and_ack
from services.common.schemas import Group, PromptJob, Trajectory
from services.common.security import SecretRef, TLSClientFiles

def group_for(job):
    rng = random.Random(hashlib.sha256(job.job_id.encode()).digest())
    trajs = []
    for i in range(job.n):
        n = rng.randint(4, 12)
        trajs.append(Trajectory(index=i, response_ids=[rng.randint(5, 400) for _ in range(n)],
                                loss_mask=[1] * n, logprobs=[-2.0] * n,
                                versions=[max(job.policy_version, 0)] * n, finish_reason="eos",
                                reward=1.0 if i % 2 == 0 else -1.0, turns=1))  # every group informative
    v = max(job.policy_version, 0)
    return Group(job_id=job.job_id, prompt_ids=[1, 2, 3, 4], trajectories=trajs, min_version=v,
                 max_version=v, job_policy_version=job.policy_version)

async def serve(client, suffix):
    prompts = RedisStream(client, f"retool:prompts:{suffix}", "rollout")
    groups = RedisStream(client, f"retool:groups:{suffix}")
    await prompts.ensure_group()
    while True:
        for m in await prompts.read("producer", count=8, block_ms=500):
            job = PromptJob.from_msgpack(m.data)
            await publish_and_ack(groups, group_for(job).to_msgpack(), prompts, [m.id])

async def main():
    auth = RedisAuth(username="rollout", password=SecretRef(file="/run/secrets/redis-rollout-password"),
                     tls=TLSClientFiles(ca_file="/run/secrets/ca"))
    client = connect("redis://redis:6379/0", auth)
    print("producer: serving", sys.argv[1:], flush=True)
    await asyncio.gather(*(serve(client, s) for s in sys.argv[1:]))

asyncio.run(main())
'''

# Run in a rollout container (its secrets under /run/secrets). ROGUE and TRAINER are replaced by the
# test with dicts of PEM texts and the trainer's password: what an attacker holds, and a control.
DOORS = r'''
import asyncio, json, os, ssl
import httpx, redis.asyncio as aioredis, torch
from services.common.security import TLSClientFiles
from services.transport.weights.client import WeightPushError, push_state_dict_async
from services.transport.weights.tls import ChannelSecurity

S = "/run/secrets/"
ROGUE = ROGUE_PEMS
TRAINER = TRAINER_SECRETS
os.makedirs("/tmp/doors", exist_ok=True)
for name, text in {**ROGUE, **{k: v for k, v in TRAINER.items() if k != "password"}}.items():
    with open(f"/tmp/doors/{name}", "w") as fh:
        fh.write(text)
D = "/tmp/doors/"
secret = lambda name: open(S + name).read().strip()
out = {}

async def redis_try(name, key="retool:prompts", **kw):
    client = aioredis.Redis(host="redis", port=6379, socket_timeout=10, socket_connect_timeout=10, **kw)
    try:
        await client.xadd(key, {"d": b"forged"})
        out[name] = "accepted"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        await client.aclose()

async def push_try(name, security, token):
    try:
        await push_state_dict_async([("doors.check", torch.zeros(1))], ["rollout-cpu:50051"], 10**6, token,
                                    security=security, timeout_s=20)
        out[name] = "accepted"
    except WeightPushError as exc:
        out[name] = exc.results.get("rollout-cpu:50051", str(exc))[:160]
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {str(exc)[:160]}"

def channel(ca, cert=None):
    return ChannelSecurity.from_files(TLSClientFiles(ca_file=ca, cert_file=cert and cert + ".crt",
                                                     key_file=cert and cert + ".key", server_name="rollout"))

async def http_try(name, method, url, **kw):
    verify = kw.pop("verify", ssl.create_default_context(cafile=S + "ca"))
    try:
        async with httpx.AsyncClient(verify=verify, timeout=180) as c:
            r = await c.request(method, url, **kw)
        out[name] = r.status_code
        out[name + ":body"] = r.text if "scored" in name else r.text[:400]
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {str(exc)[:160]}"

async def main():
    tls = dict(ssl=True, ssl_ca_certs=S + "ca", ssl_check_hostname=True)
    await redis_try("redis: TLS, no user", **tls)
    await redis_try("redis: wrong password", username="trainer", password="guessed", **tls)
    await redis_try("redis: plain text")
    await redis_try("redis: server from another CA", username="trainer", password=TRAINER["password"],
                    ssl=True, ssl_ca_certs=D + "rogue-ca.crt")
    await redis_try("redis: client certificate from another CA", username="trainer",
                    password=TRAINER["password"], ssl_certfile=D + "rogue-client.crt",
                    ssl_keyfile=D + "rogue-client.key", **tls)
    await redis_try("redis: rollout user adds a prompt", username="rollout",
                    password=secret("redis-rollout-password"), **tls)
    await redis_try("redis: trainer user adds a prompt (control)", key="retool:prompts:doors",
                    username="trainer", password=TRAINER["password"], **tls)

    token = secret("weight-token")
    await push_try("push: plain text", None, token)
    await push_try("push: TLS without a client certificate", channel(S + "ca"), token)
    await push_try("push: client certificate from another CA", channel(S + "ca", D + "rogue-client"), token)
    await push_try("push: server from another CA", channel(D + "rogue-ca.crt", D + "trainer"), token)
    await push_try("push: trainer certificate, wrong token", channel(S + "ca", D + "trainer"), "guessed")
    await push_try("push: trainer certificate and token (control)", channel(S + "ca", D + "trainer"), token)

    chat = {"model": "/models/policy", "messages": [{"role": "user", "content": "What is 6*7?"}],
            "max_tokens": 8}
    rollout = "https://rollout-cpu:8000"
    bearer = lambda t: {"Authorization": f"Bearer {t}"}
    await http_try("chat: no token", "POST", rollout + "/v1/chat/completions", json=chat)
    await http_try("chat: wrong token", "POST", rollout + "/v1/chat/completions", json=chat,
                   headers=bearer("guessed"))
    await http_try("chat: plain HTTP", "POST", rollout.replace("https", "http") + "/v1/chat/completions",
                   json=chat, headers=bearer(secret("rollout-token")))
    await http_try("chat: server from another CA", "POST", rollout + "/v1/chat/completions", json=chat,
                   headers=bearer(secret("rollout-token")), verify=ssl.create_default_context(
                       cafile=D + "rogue-ca.crt"))
    await http_try("chat: token (control)", "POST", rollout + "/v1/chat/completions", json=chat,
                   headers=bearer(secret("rollout-token")))
    body = {"messages": [{"role": "user", "content": "What is 6*7?"}], "ground_truth": "42", "n": 2,
            "max_turns": 1, "sampling": {"max_tokens": 16}}
    await http_try("rollouts: token, scored (control)", "POST", rollout + "/v1/rollouts", json=body,
                   headers=bearer(secret("rollout-token")))
    run = {"code": "print(6*7)", "language": "python"}
    await http_try("run_code: no token", "POST", "http://sandbox:8080/run_code", json=run)
    await http_try("run_code: wrong token", "POST", "http://sandbox:8080/run_code", json=run,
                   headers=bearer("guessed"))
    await http_try("run_code: the rollout token", "POST", "http://sandbox:8080/run_code", json=run,
                   headers=bearer(secret("rollout-token")))
    await http_try("run_code: sandbox token (control)", "POST", "http://sandbox:8080/run_code", json=run,
                   headers=bearer(secret("sandbox-token")))
    score = {"response": "\\boxed{42}", "ground_truth": "42"}
    await http_try("score: no token", "POST", "http://reward:8090/score", json=score)
    await http_try("score: reward token (control)", "POST", "http://reward:8090/score", json=score,
                   headers=bearer(secret("reward-token")))
    await http_try("healthz: no token (open)", "GET", rollout + "/healthz")
    print(json.dumps(out))

asyncio.run(main())
'''
