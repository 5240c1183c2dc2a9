"""The multi-machine override under a real Docker engine: every link secured, every door attacked,
and a trainer of two nodes (two containers) in one torchrun world.

One bring-up (CI: with the compose smoke test's image). Compose itself merges the project's
docker-compose.yml and docker-compose.multinode.yml (``docker compose config``); the test then
changes only the topology, as one host must fake several machines: no ports published on the
shared engine, and the CPU trainer replaced by
- ``trainer-node0`` / ``trainer-node1``: nodes 0 and 1 of one world (``--nnodes 2``, c10d rendezvous
  at trainer-node0:29400, gloo, one process each), on a network of their own (``trainers``) plus the
  cluster network (``nodes``), never on the rollout side's ``backend``; they share a checkpoint
  directory (the NFS of a real cluster) and push to the rollout replica over mutual TLS;
- ``trainer-ref``: ONE node of two processes (the same world size) on the same batches;
- ``producer``: the rollout side of the trainers' streams, as the ``rollout`` ACL user over TLS,
  answering each prompt job with a group seeded by its job id (same jobs -> same batches).
Phases, each timed:
1. build (cached) and a tiny model, data, secrets (``retool secrets init`` + a rogue CA);
2. up: Redis (TLS port only, ACL), sandbox, reward, rollout (HTTPS, tokens, gRPC mTLS), Prometheus;
3. doors, from inside the rollout container: Redis XADD, the gRPC push, /v1/chat/completions and
   /run_code refuse no credentials, wrong ones, plain text and another CA's certificates; the right
   ones work (a scored rollout, a chat completion); Prometheus scrapes the rollout over HTTPS;
4. the two-node trainer makes >= 3 steps; only global rank 0 writes metrics and pushes (the
   replica's push counter equals the steps); the checkpoint has one shard per rank; its losses equal
   the one-node run's for the same steps (float tolerance);
5. node 1 is killed: node 0 fails the step loudly (exits non-zero, the error in its log) within a
   deadline (gloo sees the peer go; ``fsdp.timeout_s`` bounds it otherwise);
6. both nodes restart and resume from the shared checkpoint, and step on.
What it cannot show: NCCL (gloo on CPU here), real network latency or loss between machines, host
networking (the trainer's ``network_mode: host`` across real hosts), and Docker's iptables rules (the
engine here runs without them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.common.files import make_world_readable
from services.demo.task import rl_rows, write_parquet
from tests.deploy.engine import (
    REPO,
    Compose,
    Phases,
    build_image,
    require_engine,
    wait_for,
    write_compose_env,
)
from tests.deploy.multinode_scripts import DOORS, PRODUCER
from tests.deploy.test_compose_smoke import _prometheus
from tests.helpers.secure import mint

pytestmark = pytest.mark.integration
IMAGE = os.environ.get("RETOOL_SMOKE_IMAGE", "retool:cpu")
MIN_STEPS = 3
TRAINER_TIMEOUT_S = 150  # fsdp.timeout_s: > group_wait_s + weight_push_wait_s (checked by RunConfig)


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)  # the services' uid (10001) writes here
    return path


def _run_config(streams: str, targets: list[str], port: int | None) -> dict:
    return {
        "dataset": "/data/rl.parquet", "redis_url": "redis://redis:6379/0",
        "prompts_stream": f"retool:prompts:{streams}", "groups_stream": f"retool:groups:{streams}",
        "rollout_targets": targets, "metrics_path": "/runs/metrics.jsonl", "metrics_port": port,
        "group_wait_s": 90, "weight_push_wait_s": 30, "max_steps": 1000,
        "trainer": {"model_path": "/models/policy", "batch_prompts": 2, "group_size": 2, "mini_batch_size": 4,
                    "max_prompt_len": 64, "max_response_len": 48, "micro_batch_max_tokens": 512,
                    "lr": 1e-4, "save_freq": 2, "keep_last_checkpoints": 3, "total_epochs": 100,
                    "checkpoint_dir": "/checkpoints", "val_before_train": False,
                    "dynamic_sampling": {"enabled": False},
                    "fsdp": {"backend": "gloo", "param_dtype": "fp32", "gradient_checkpointing": False,
                             "timeout_s": TRAINER_TIMEOUT_S}},
    }


def _prepare(tmp: Path) -> dict[str, Path]:
    paths = {"model": tmp / "model", "data": tmp / "data"}
    problems = [(a, b) for a in range(11, 19) for b in range(21, 29)]
    write_parquet(paths["data"] / "rl.parquet", rl_rows(problems, "train"))
    make_world_readable(paths["data"])
    cli = [sys.executable, "-m", "services.cli", "model", "init-tiny", "--size", "small"]
    proc = subprocess.run([*cli, "--out", str(paths["model"])], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    make_world_readable(paths["model"])
    paths["secrets"] = mint(tmp / "secrets").dir
    configs = _dir(tmp / "configs")
    for name, cfg in (("node.yaml", _run_config("2n", ["dns:rollout-cpu:50051"], 9100)),
                      ("ref.yaml", _run_config("ref", [], None))):
        (configs / name).write_text(yaml.safe_dump(cfg))
        (configs / name).chmod(0o644)
    (configs / "produce.py").write_text(PRODUCER)
    (configs / "produce.py").chmod(0o644)
    for name in ("node0", "node1", "ref"):
        paths[f"runs-{name}"] = _dir(tmp / f"runs-{name}")
    paths["ckpt-2n"], paths["ckpt-ref"] = _dir(tmp / "ckpt-2n"), _dir(tmp / "ckpt-ref")
    paths["configs"] = configs
    return paths


def _trainer(base: dict, *, hostname: str, nnodes: int, nproc: int, endpoint: str, is_host: bool,
             config: Path, runs: Path, ckpt: Path, rdzv_id: str) -> dict:
    """The merged ``trainer-cpu`` (its secrets and settings from the override) as one trainer node."""
    svc = {k: v for k, v in base.items() if k not in ("network_mode", "depends_on", "healthcheck", "ports")}
    svc.update(
        hostname=hostname, restart="no",
        command=[f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", f"--rdzv-conf=is_host={int(is_host)}",
                 "-m", "services.cli", "trainer", "run", "--config", "/etc/retool/run.yaml"],
        networks={"trainers": {}, "nodes": {}},
        volumes=[v for v in base["volumes"] if v["target"] in ("/models/policy", "/data")] + [
            {"type": "bind", "source": str(config), "target": "/etc/retool/run.yaml", "read_only": True},
            {"type": "bind", "source": str(runs), "target": "/runs"},
            {"type": "bind", "source": str(ckpt), "target": "/checkpoints"}],
        environment={**base["environment"], "OMP_NUM_THREADS": "1"},
        depends_on={"redis": {"condition": "service_healthy"},
                    "rollout-cpu": {"condition": "service_healthy"}},
    )
    return svc


def _compose(tmp: Path, paths: dict[str, Path]) -> Compose:
    env = tmp / "secure.env"
    write_compose_env(env, image=IMAGE, model=paths["model"], data=paths["data"], sandbox_concurrency=4,
                      extra=(f"RETOOL_SECRETS_DIR={paths['secrets']}", "NODE_ADDR=127.0.0.1",
                             f"RETOOL_SECRETS_GID={(paths['secrets'] / 'redis.key').stat().st_gid}"))
    project = f"retool-secure-{os.getpid()}"
    merged_from = Compose(project, env, [REPO / "deploy" / "docker-compose.yml",
                                         REPO / "deploy" / "docker-compose.multinode.yml"])
    merged = yaml.safe_load(merged_from.cmd("config", timeout=120).stdout)
    services = merged["services"]
    # `config` resolves volume paths but not security_opt's: the sandbox's seccomp profile is
    # relative to deploy/, which the merged file (in tmp) no longer sits in
    services["sandbox"]["security_opt"] = [o.replace("seccomp=./", f"seccomp={REPO / 'deploy'}/")
                                           for o in services["sandbox"]["security_opt"]]
    for name in ("redis", "rollout-cpu"):  # one shared engine: publish nothing on the host
        services[name].pop("ports", None)
    services["rollout-cpu"]["environment"]["OMP_NUM_THREADS"] = "1"
    trainer = services.pop("trainer-cpu")
    common = {"rdzv_id": "retool-2n", "config": paths["configs"] / "node.yaml", "ckpt": paths["ckpt-2n"]}
    services["trainer-node0"] = _trainer(trainer, hostname="trainer-node0", nnodes=2, nproc=1,
                                         endpoint="trainer-node0:29400", is_host=True,
                                         runs=paths["runs-node0"], **common)
    services["trainer-node1"] = _trainer(trainer, hostname="trainer-node1", nnodes=2, nproc=1,
                                         endpoint="trainer-node0:29400", is_host=False,
                                         runs=paths["runs-node1"], **common)
    services["trainer-ref"] = _trainer(trainer, hostname="trainer-ref", nnodes=1, nproc=2,
                                       endpoint="127.0.0.1:29400", is_host=True, rdzv_id="retool-ref",
                                       config=paths["configs"] / "ref.yaml", runs=paths["runs-ref"],
                                       ckpt=paths["ckpt-ref"])
    services["producer"] = {
        "image": IMAGE, "entrypoint": ["python"], "command": ["/etc/retool/produce.py", "2n", "ref"],
        "restart": "no", "init": True, "networks": {"nodes": {}},
        "volumes": [{"type": "bind", "source": str(paths["configs"] / "produce.py"),
                     "target": "/etc/retool/produce.py", "read_only": True}],
        "secrets": [{"source": "ca"}, {"source": "redis-rollout-password"}],
        # the password file is 0640, readable through the secrets group as by every real service
        "group_add": list(services["rollout-cpu"]["group_add"]),
        "depends_on": {"redis": {"condition": "service_healthy"}},
    }
    merged["networks"]["trainers"] = {"internal": True}
    final = tmp / "secure.compose.yml"
    final.write_text(yaml.safe_dump(merged, sort_keys=False))
    return Compose(project, env, [final])


def _metrics(runs: Path) -> list[dict]:
    path = runs / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _step(runs: Path) -> int:
    rows = _metrics(runs)
    return int(rows[-1]["step"]) if rows else 0


def _state(c: Compose, service: str) -> dict:
    rows = [x for x in c.containers() if x.get("Service") == service]
    return rows[0] if rows else {}


ROLLOUT_STATE = """
import json, re, ssl, urllib.request
ctx = ssl.create_default_context(cafile="/run/secrets/ca")
def get(path):
    return urllib.request.urlopen("https://localhost:8000" + path, timeout=20, context=ctx).read().decode()
pushes = re.search(r'^rollout_weight_pushes_total\\{outcome="ok"\\} (\\S+)', get("/metrics"), re.M)
version = json.loads(get("/healthz"))["weight_version"]
print(json.dumps({"version": version, "pushes": float(pushes.group(1))}))
"""


def _check_doors(out: dict) -> None:
    refused_redis = {"redis: TLS, no user": ("NOAUTH", "authenticated"),
                     "redis: wrong password": ("WRONGPASS", "invalid username-password"),
                     "redis: plain text": ("ConnectionError",),
                     "redis: server from another CA": ("certificate verify failed",),
                     # TLS 1.3: the client's handshake ends before the server has checked its
                     # certificate, so the refusal reaches it as the alert or as a reset, by timing
                     "redis: client certificate from another CA": ("UNKNOWN_CA", "unknown ca",
                                                                   "Connection reset by peer"),
                     "redis: rollout user adds a prompt": ("NoPermissionError", "NOPERM")}
    for name, words in refused_redis.items():
        assert out[name] != "accepted" and any(w in out[name] for w in words), (name, out[name])
    assert out["redis: trainer user adds a prompt (control)"] == "accepted", out
    for name in ("push: plain text", "push: TLS without a client certificate",
                 "push: client certificate from another CA", "push: server from another CA"):
        assert out[name].startswith("UNAVAILABLE"), (name, out[name])
    assert out["push: trainer certificate, wrong token"].startswith("UNAUTHENTICATED"), out
    # past both doors, refused only for what it carries (no such weight): weights untouched
    assert out["push: trainer certificate and token (control)"].startswith("INVALID_ARGUMENT"), out
    for name in ("chat: no token", "chat: wrong token", "run_code: no token", "run_code: wrong token",
                 "run_code: the rollout token", "score: no token"):
        assert out[name] == 401, (name, out[name], out.get(name + ":body"))
    assert "Error" in str(out["chat: plain HTTP"]), out["chat: plain HTTP"]  # no answer in plain text
    assert "CERTIFICATE_VERIFY_FAILED" in str(out["chat: server from another CA"]), out
    assert out["chat: token (control)"] == 200, out.get("chat: token (control):body")
    assert out["run_code: sandbox token (control)"] == 200, out
    assert json.loads(out["run_code: sandbox token (control):body"])["run_result"]["stdout"] == "42\n"
    assert out["score: reward token (control)"] == 200 and out["healthz: no token (open)"] == 200, out
    assert out["rollouts: token, scored (control)"] == 200, out.get("rollouts: token, scored (control):body")


@pytest.mark.timeout(2400)
@pytest.mark.slow(reason="a TLS multinode compose stack with a two-node trainer, under Docker", budget_s=1800)
def test_secure_multinode_deployment_with_a_two_node_trainer(tmp_path_factory):
    require_engine()
    phases = Phases()
    build_image(IMAGE)
    tmp = tmp_path_factory.mktemp("multinode")
    tmp.chmod(0o755)
    paths = _prepare(tmp)
    c = _compose(tmp, paths)
    phases.done("build (cached), tiny model, data, secrets")
    base = ["redis", "sandbox", "reward", "rollout-cpu", "prometheus"]
    trainers = ["trainer-node0", "trainer-node1", "trainer-ref"]
    try:
        c.cmd("up", "-d", "--no-build", *base, "producer", timeout=900)
        wait_for("redis, sandbox, reward, rollout healthy",
                 lambda: all(_state(c, s).get("Health") == "healthy" for s in base),
                 timeout_s=600, diag=lambda: "\n".join(c.logs(s, 40) for s in [*base, "producer"]))
        phases.done("secure bring-up healthy")

        # 3. every door, from the rollout container (the rogue material is what an attacker holds)
        sec = paths["secrets"]
        rogue = {n: (sec / n).read_text() for n in ("rogue-ca.crt", "rogue-client.crt", "rogue-client.key")}
        trainer = {name: (sec / name).read_text() for name in ("trainer.crt", "trainer.key")}
        trainer["password"] = (sec / "redis-trainer-password").read_text().strip()
        doors = DOORS.replace("ROGUE_PEMS", repr(rogue)).replace("TRAINER_SECRETS", repr(trainer))
        out = c.json_from("rollout-cpu", doors, timeout=600)
        print(json.dumps(out, indent=1)[:20000])
        _check_doors(out)  # type: ignore[arg-type]
        scored = json.loads(out["rollouts: token, scored (control):body"])  # type: ignore[index]
        assert all(t["reward"] is not None for t in scored["trajectories"]), scored
        wait_for("Prometheus scrapes the rollout over HTTPS",
                 lambda: [t["health"] for t in _prometheus(c, "/api/v1/targets?state=active")["data"]
                          ["activeTargets"] if t["labels"]["job"] == "rollout"] == ["up"],
                 timeout_s=120, interval_s=3,
                 diag=lambda: json.dumps(_prometheus(c, "/api/v1/targets"))[-2000:])
        phases.done("doors: every stranger refused, every control accepted")

        # 4. two nodes of one world, and one node of the same world size, on the same batches
        c.cmd("up", "-d", "--no-build", "--no-deps", *trainers, timeout=300)
        diag = lambda: "\n".join(c.logs(s, 60) for s in [*trainers, "producer", "rollout-cpu"])  # noqa: E731
        wait_for(f">= {MIN_STEPS} steps on both runs",
                 lambda: min(_step(paths["runs-node0"]), _step(paths["runs-ref"])) >= MIN_STEPS + 1,
                 timeout_s=600, interval_s=3, diag=diag)
        assert not (paths["runs-node1"] / "metrics.jsonl").exists()  # rank 0 is node 0; only rank 0 writes
        state = c.json_from("rollout-cpu", ROLLOUT_STATE)
        steps_now = _step(paths["runs-node0"])
        # every push came from rank 0 alone: one push per step, never two (at most one in flight)
        assert steps_now - 1 <= state["pushes"] <= steps_now + 1, (state, steps_now)  # type: ignore[index]
        assert state["version"] >= MIN_STEPS, state  # type: ignore[index]
        two, ref = _metrics(paths["runs-node0"]), _metrics(paths["runs-ref"])
        compared = min(len(two), len(ref))
        assert compared >= MIN_STEPS
        for a, b in zip(two[:compared], ref[:compared], strict=True):
            assert a["step"] == b["step"]
            for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key, a[key], b[key])
        print("pg_loss two nodes / one node:", [(a["actor/pg_loss"], b["actor/pg_loss"])
                                                for a, b in zip(two[:compared], ref[:compared], strict=True)])
        ckpts = sorted(p for p in paths["ckpt-2n"].iterdir() if p.name.startswith("step_"))
        assert ckpts, list(paths["ckpt-2n"].iterdir())
        meta = json.loads((ckpts[-1] / "meta.json").read_text())
        shards = sorted(p.name for p in (ckpts[-1] / "state").glob("*.distcp"))
        assert meta["world_size"] == 2 and shards == ["__0_0.distcp", "__1_0.distcp"], (meta, shards)
        phases.done(f"two-node trainer: {steps_now} steps, losses of {compared} steps equal the one-node "
                    "run's, sharded checkpoint")
        c.cmd("stop", "--timeout", "20", "trainer-ref", timeout=120, check=False)

        # 5. kill node 1: node 0 fails the step loudly, within a deadline
        before_kill = _step(paths["runs-node0"])
        c.cmd("kill", "trainer-node1", timeout=60)
        killed_at = time.monotonic()
        state0 = wait_for("node 0 fails after node 1 died",
                          lambda: (s := _state(c, "trainer-node0")).get("State") == "exited" and s,
                          timeout_s=TRAINER_TIMEOUT_S + 90, interval_s=2, diag=diag)
        failed_after = time.monotonic() - killed_at
        assert state0.get("ExitCode") not in (0, None), state0
        log0 = c.logs("trainer-node0", 400)
        assert "ChildFailedError" in log0 or "failed" in log0.lower(), log0[-3000:]
        print("node 0's error:", [line for line in log0.splitlines()
                                  if re.search(r"gloo|Connection|peer|ChildFailedError", line)][:6])
        phases.done(f"node 1 killed at step ~{before_kill}: node 0 exited {state0.get('ExitCode')} "
                    f"after {failed_after:.0f} s")

        # 6. both nodes restart and resume from the shared checkpoint
        last = max(int(p.name.removeprefix("step_")) for p in paths["ckpt-2n"].iterdir()
                   if p.name.startswith("step_"))
        started = int(time.time()) - 1
        c.cmd("start", "trainer-node0", "trainer-node1", timeout=300)

        def resumed() -> int | None:
            p = c.cmd("logs", "--no-color", "--since", str(started), "trainer-node0", timeout=60, check=False)
            text = p.stdout + p.stderr
            if "resumed from " not in text:
                return None
            return int(text[text.rindex("resumed from "):].split("(step ", 1)[1].split(",", 1)[0])

        step = wait_for("node 0 resumed", resumed, timeout_s=300, interval_s=3, diag=diag)
        assert step == last, (step, last)
        wait_for("a step after the resume", lambda: _step(paths["runs-node0"]) > step + 1, timeout_s=300,
                 interval_s=3, diag=diag)
        phases.done(f"both nodes restarted, resumed from step {step}")
    except BaseException:
        print("\n".join(c.logs(s, 80) for s in [*base, *trainers, "producer"]))
        raise
    finally:
        c.cmd("down", "-v", "--remove-orphans", "--timeout", "10", timeout=300, check=False)
    assert c.containers() == []
    phases.done("compose down -v")
    print(json.dumps(phases.times))
