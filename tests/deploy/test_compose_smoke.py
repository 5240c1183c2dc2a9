"""``docker compose up`` of the CPU profile, really run under a Docker engine, and driven.

Runs whenever a Docker engine answers (CI: always; ``.ci/run`` starts one and sets
``RETOOL_DOCKER_TESTS=require`` so a missing engine fails instead of skipping). Phases, each
timed and printed:

1. ``docker build`` of the CPU image (deploy/docker/Dockerfile; layers cached between runs);
2. ``compose up`` of the CPU profile with the project's own compose file: Redis, sandbox,
   reward, two rollout-cpu replicas (``--scale``), trainer-cpu, Prometheus, and Grafana where
   its image exists. The test-side overrides are the trainer's run config (small batches, a
   checkpoint every 2 steps), the model/data directories (a ``small`` random model from
   ``retool model init-tiny``, written under a umask of 077 like a hardened root shell), and
   those of the chaos test, which runs next on the same stack (one bring-up for both,
   tests/deploy/cpu_stack.py: they lie idle until a fault uses them);
3. every container healthy, and the sandbox reports per-run cgroups *inside its container*;
4. hostile code through the deployed sandbox (sent from a rollout container, as the rollout
   service sends it): a memory bomb of many processes is held to the run's cgroup limit, a
   fork bomb ends, a run has no network at all; and the sandbox *container* has no route to
   Redis (not by name, not by address); the escape probes (``tests/deploy/sandbox_escape.py``:
   canaries and sockets of the sandbox's container, namespaces, the syscall filter, /proc and
   devices, another run's processes and /tmp), stateless and through a session, and CPU hogs
   in every other slot while /healthz is timed and a hello run completes; the sandbox container
   runs under the project's seccomp profile (``docker inspect``), which a process there that is
   not a run (``tests/deploy/container_seccomp.py``) finds denying the kernel surface the service
   does not need (``EPERM``) and allowing what it does;
5. a rollout over HTTP with the agent loop (``max_turns`` 3), scored by the reward service;
6. the trainer completes >= 3 steps and each one is pushed to BOTH replicas (each replica's
   weight version equals the trainer's step);
7. Prometheus scrapes every target up (sandbox, reward, both replicas, trainer);
8. the trainer container is restarted and resumes from its checkpoint;
9. ``docker compose down -v`` leaves no container or volume of the project.

What it cannot show (see docs/validation.md): the GPU profile (no CUDA image or GPU here),
several machines, and Docker's own iptables isolation of internal networks where the engine
runs with iptables off (the route-level isolation checked in phase 4 holds without it).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.files import make_world_readable
from services.demo.task import question, rl_rows, sft_messages, write_parquet
from services.sandbox import container_profile
from tests.deploy import container_seccomp, sandbox_escape
from tests.deploy.engine import (
    REPO,
    Compose,
    Phases,
    run,
    wait_for,
)
from tests.helpers.hostile_code import MemoryBombVerdict, forked_memory_bomb

pytestmark = pytest.mark.integration
REPLICAS = 2
MIN_STEPS = 3


SFT_STEPS = 20
TRAINER_ENV = ("TRAINER_CPU_THREADS=1", "TRAINER_NPROC=1", "CHECKPOINT_DIR=checkpoints")


def _prepare(tmp: Path) -> tuple[Path, Path, Path]:
    """Model, data and the trainer's run config.

    The model: ``retool model init-tiny --size small``, then a short SFT (``retool sft run``) on
    four tool-use traces so that it answers with a ``<code>`` call (multi-turn rollouts). Both
    run under umask 077, as in a hardened root shell: the container user must still read them.
    """
    problems = [(a, b) for a in range(11, 19) for b in range(21, 29)]
    data = tmp / "data"
    write_parquet(data / "rl.parquet", rl_rows(problems, "train"))
    make_world_readable(data)
    traces = tmp / "sft.jsonl"
    traces.write_text("".join(json.dumps({"messages": sft_messages(a, b, True)}) + "\n"
                              for a, b in [(12, 34), (13, 21), (15, 27), (17, 22)]))
    sft = {"model_path": str(tmp / "init"), "data": {"train_files": [str(traces)], "max_length": 256},
           "epochs": 1000, "max_steps": SFT_STEPS, "batch_size": 4, "micro_batch_size": 4,
           "optim": {"lr": 3e-3, "warmup_ratio": 0.0}, "progress": False,
           "fsdp": {"param_dtype": "fp32", "gradient_checkpointing": False},
           "checkpoint": {"dir": str(tmp / "sft-ckpt"), "save_freq": 10**6, "resume": "never"},
           "output_dir": str(tmp / "model"), "metrics_path": str(tmp / "sft-metrics.jsonl")}
    (tmp / "sft.yaml").write_text(yaml.safe_dump(sft))
    cli = [sys.executable, "-m", "services.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for args in (["model", "init-tiny", "--size", "small", "--out", str(tmp / "init")],
                 ["sft", "run", "--config", str(tmp / "sft.yaml")]):
        proc = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=900, umask=0o077,
                              env=env, cwd=REPO)
        assert proc.returncode == 0, (args, proc.stderr[-3000:])
    cfg = yaml.safe_load((REPO / "deploy" / "trainer" / "tiny-cpu.yaml").read_text())
    cfg["sampling"]["max_tokens"] = 48
    cfg["max_steps"] = 1000
    # every group trains (dynamic sampling would drop the SFT model's all-correct groups: no steps)
    cfg["trainer"].update(batch_prompts=2, group_size=2, mini_batch_size=4, max_response_len=48,
                          save_freq=2, total_epochs=100, dynamic_sampling={"enabled": False})
    run_cfg = tmp / "smoke-cpu.yaml"
    run_cfg.write_text(yaml.safe_dump(cfg))
    run_cfg.chmod(0o644)
    return tmp / "model", data, run_cfg


SERVICES = ["redis", "sandbox", "reward", "prometheus", "rollout-cpu", "trainer-cpu"]


def _health(c: Compose) -> dict[str, str]:
    return {x["Name"]: (x.get("Health") or x.get("State")) for x in c.containers()}


def _diag(c: Compose) -> str:
    return "\n".join(f"--- {s}\n{c.logs(s, 60)[-4000:]}" for s in [*SERVICES, "grafana"])


def _get(c: Compose, service: str, url: str, index: int = 1) -> dict:
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=20).read().decode())"
    return c.json_from(service, code, index=index)  # type: ignore[return-value]


def _post_script(url: str, body: dict, timeout: float) -> str:
    """Python that POSTs ``body`` as JSON to ``url`` and prints the JSON answer (run in a container)."""
    return ("import json, urllib.request\n"
            f"req = urllib.request.Request({url!r}, data={json.dumps(body).encode()!r}, "
            "headers={'content-type': 'application/json'})\n"
            f"print(urllib.request.urlopen(req, timeout={timeout}).read().decode())\n")


def _run_code(c: Compose, code: str, **kw) -> dict:
    """POST /run_code from inside a rollout replica (the route the rollout service uses)."""
    body = {"code": code, "language": "python", **kw}
    return c.json_from("rollout-cpu", _post_script("http://sandbox:8080/run_code", body, 180),  # type: ignore[return-value]
                       timeout=240)


def _stdout(r: dict) -> str:
    return (r.get("run_result") or {}).get("stdout") or ""


# 8 children of 200 MB; the run's cgroup admits memory_limit_MB + tmpfs (64) + slack (256) =
# 576 MB, so at most two hold their memory at once. No sleep decides: the parent waits (with
# a deadline) until every child has allocated or been killed.
MEMORY_BOMB = forked_memory_bomb(children=8, mb=200, settle_s=60)

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"

NO_NETWORK = """
import socket
out = {}
for name, target in (("redis", ("redis", 6379)), ("sandbox", ("sandbox", 8080)), ("ip", ("1.1.1.1", 53))):
    try:
        socket.create_connection(target, timeout=3).close()
        out[name] = "connected"
    except OSError as exc:
        out[name] = type(exc).__name__
print(sorted(name for _, name in socket.if_nameindex()), out)  # interfaces of the run's netns
"""

# Run by the sandbox *service* container itself (root, not a run): can it reach Redis?
SANDBOX_CONTAINER_TO_REDIS = """
import json, socket
out = {}
try:
    socket.getaddrinfo("redis", 6379)
    out["dns"] = "resolved"
except OSError as exc:
    out["dns"] = type(exc).__name__
ips = REDIS_IPS
for ip in ips:
    try:
        socket.create_connection((ip, 6379), timeout=3).close()
        out[ip] = "connected"
    except OSError as exc:
        out[ip] = f"{type(exc).__name__}: {exc.strerror}"
print(json.dumps(out))
"""


def _inspect(c: Compose, service: str, field: str) -> Any:
    (cid,) = c.cmd("ps", "-q", service, timeout=60).stdout.split()
    return json.loads(run(["docker", "inspect", "--format", f"{{{{json {field}}}}}", cid], timeout=60).stdout)


def _container_ips(c: Compose, service: str) -> list[str]:
    nets = _inspect(c, service, ".NetworkSettings.Networks")
    return [n["IPAddress"] for n in nets.values() if n.get("IPAddress")]


def _seccomp_profile(c: Compose, service: str) -> dict | None:
    """The seccomp profile the engine was given for ``service`` (compose sends the file's content)."""
    opts = [o.split("=", 1)[1] for o in _inspect(c, service, ".HostConfig.SecurityOpt") or []
            if o.startswith("seccomp=")]
    return json.loads(opts[0]) if opts else None


# Run in the trainer's container, in one go (the CPU trainer steps about once a second): the
# trainer's step, then every rollout replica's weight version (each A record of `rollout`, as
# the trainer's dns: target resolves it), then the step again.
PUSH_PROBE = """
import json, socket, urllib.request
def get(url):
    return json.loads(urllib.request.urlopen(url, timeout=10).read())
ips = sorted({a[4][0] for a in socket.getaddrinfo("rollout", 8000, proto=socket.IPPROTO_TCP)})
before = get("http://127.0.0.1:9100/healthz")["step"]
versions = [get(f"http://{ip}:8000/healthz")["weight_version"] for ip in ips]
after = get("http://127.0.0.1:9100/healthz")["step"]
print(json.dumps({"before": before, "versions": versions, "after": after}))
"""


def _steps_and_versions(c: Compose) -> tuple[int, list[int], int]:
    got = c.json_from("trainer-cpu", PUSH_PROBE)
    return got["before"], got["versions"], got["after"]  # type: ignore[index]


def _prometheus(c: Compose, path: str) -> dict:
    port = next(line.split("=", 1)[1] for line in c.env_file.read_text().splitlines()
                if line.startswith("PROMETHEUS_PORT="))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.timeout(3000)
@pytest.mark.slow(reason="builds the image if no other deploy test did, then the whole CPU "
                  "compose profile trains", budget_s=2400)
def test_cpu_profile_under_a_real_docker_engine(cpu_stack):
    phases = Phases()
    # 1.-2. the image, as a user builds it (classic builder: no BuildKit on every engine), the model
    # and data, and the bring-up; shared with the chaos test, which runs next on the same stack
    shared = cpu_stack.get(phases)
    c, services = shared.stack.c, shared.services
    try:
        # 3. all healthy; the sandbox enforces per-run cgroups inside its container
        expected = len(services) + REPLICAS - 1
        wait_for("every container healthy",
                 lambda: (h := _health(c)) and len(h) == expected and all(v == "healthy" for v in h.values()),
                 timeout_s=600, diag=lambda: f"{_health(c)}\n{_diag(c)}")
        health = _get(c, "rollout-cpu", "http://sandbox:8080/healthz")
        assert health["cgroups"] in (1, 2), f"per-run cgroups not enforced in the container: {health}"
        assert health["warnings"] == [] and health["zygote_restarts"] == 0, health
        assert health["isolation"] == "ok" and health["isolation_gaps"] == [], health
        phases.done("wait healthy")

        # 4. hostile code inside the deployment
        r = _run_code(c, MEMORY_BOMB, memory_limit_MB=256, run_timeout=90)
        verdict = MemoryBombVerdict.parse(_stdout(r))
        assert verdict.settled, r
        # the run's cgroup, not the container, stopped it
        assert 1 <= verdict.holding <= 2 and verdict.killed >= 6, r
        r = _run_code(c, FORK_BOMB, run_timeout=3)
        assert r["status"] == "Failed", r
        r = _run_code(c, NO_NETWORK)
        assert r["status"] == "Success", r
        assert _stdout(r).startswith("['lo'] {") or _stdout(r).startswith("[] {"), r
        assert "connected" not in _stdout(r), r
        redis_ips = _container_ips(c, "redis")
        reach = c.json_from("sandbox", SANDBOX_CONTAINER_TO_REDIS.replace("REDIS_IPS", repr(redis_ips)))
        assert reach["dns"] != "resolved", reach  # type: ignore[index]
        assert not any(v.startswith("connected") for v in reach.values()), reach  # type: ignore[union-attr]
        tag = f"retool-canary-{secrets.token_hex(6)}"
        report = sandbox_escape.report_of(c.python("sandbox", sandbox_escape.in_sandbox_container(tag),
                                                   timeout=600).stdout)
        found = {probe: b for probe, b in sandbox_escape.breaches(report, tag).items() if b}
        assert found == {}, found
        busy = 7  # every slot but one (SANDBOX_MAX_CONCURRENCY=8): the hello run gets the last
        hogs = sandbox_escape.report_of(c.python("rollout-cpu", sandbox_escape.cpu_hogs(busy, 12.0),
                                                 timeout=300).stdout)
        assert sandbox_escape.verdict_cpu(hogs, busy) == [], hogs
        # the container's own seccomp profile, held by what is not a run (here: an exec'd process)
        assert _seccomp_profile(c, "sandbox") == container_profile.profile()
        outer = c.json_from("sandbox", container_seccomp.PROBE, timeout=120)
        assert container_seccomp.breaches(outer) == [], outer  # type: ignore[arg-type]
        # the CPU hogs' runs were cut by their client; their slots come back once each run is reaped
        wait_for("every sandbox slot free again",
                 lambda: (h := _get(c, "rollout-cpu", "http://sandbox:8080/healthz"))["status"] == "ok"
                 and h["in_flight"] == 0 and h, timeout_s=60, diag=lambda: _diag(c))
        assert _stdout(_run_code(c, "print(6*7)")).strip() == "42"  # still serving after the bombs
        phases.done("hostile code (memory bomb, fork bomb, no network, sandbox->redis, escape probes, "
                    "CPU hogs, the container's seccomp profile)")

        # 5. a rollout over HTTP through the agent loop (trainer container -> rollout:8000)
        body = {"messages": [{"role": "user", "content": question(14, 25)}],
                "ground_truth": "350", "n": 4, "max_turns": 3, "sampling": {"max_tokens": 64, "seed": 1}}
        script = _post_script("http://rollout:8000/v1/rollouts", body, 300)
        out = c.json_from("trainer-cpu", script, timeout=360)
        trajectories = out["trajectories"]  # type: ignore[index]
        assert len(trajectories) == 4
        for t in trajectories:
            assert len(t["response_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) > 0, t
            assert t["reward"] is not None and t["finish_reason"], t
        # multi-turn: a tool call ran in the deployed sandbox and its output came back as a turn
        tool_turns = [t for t in trajectories
                      if t["tool_calls"] >= 1 and "<interpreter>" in t["response_text"]]
        assert tool_turns, [t["response_text"] for t in trajectories]
        assert any(0 in t["loss_mask"] for t in tool_turns)  # the interpreter's text is not trained on
        phases.done(f"rollout over HTTP ({len(tool_turns)}/4 multi-turn with tool calls)")

        # 6. >= 3 steps, each pushed to both replicas
        def pushed() -> tuple[int, list[int]] | None:
            before, versions, after = _steps_and_versions(c)
            ok = before == after >= MIN_STEPS and versions == [after] * REPLICAS
            return (after, versions) if ok else None

        step, versions = wait_for(f"trainer step >= {MIN_STEPS} on both replicas", pushed, timeout_s=900,
                                  interval_s=3, diag=lambda: c.logs("trainer-cpu", 80))
        phases.done(f"trainer {step} steps, pushed to {len(versions)} replicas")

        # 7. Prometheus scrapes every target
        def targets_up() -> list[tuple[str, str]] | None:
            active = _prometheus(c, "/api/v1/targets?state=active")["data"]["activeTargets"]
            jobs = [(t["labels"]["job"], t["health"]) for t in active]
            want = {"sandbox": 1, "reward": 1, "rollout": REPLICAS, "trainer": 1}
            ok = all(sum(1 for j, h in jobs if j == job and h == "up") == n for job, n in want.items())
            return jobs if ok and len(jobs) == sum(want.values()) else None

        wait_for("Prometheus: every target up", targets_up, timeout_s=180, interval_s=3,
                 diag=lambda: json.dumps(_prometheus(c, "/api/v1/targets"))[-3000:])
        q = _prometheus(c, "/api/v1/query?query=rollout_weight_version")["data"]["result"]
        assert len(q) == REPLICAS, q
        phases.done("prometheus targets up")

        # 8. restart the trainer: it resumes from its checkpoint
        c.cmd("restart", "trainer-cpu", timeout=300)
        shared.trainer_restarts += 1  # one more resume in the ledger the chaos test checks
        started = time.time()

        def resumed() -> int | None:
            logs = c.cmd("logs", "--no-color", "--since", str(int(started) - 1), "trainer-cpu",
                         timeout=60, check=False)
            text = logs.stdout + logs.stderr
            marker = "resumed from "
            if marker not in text:
                return None
            tail = text[text.rindex(marker):]
            return int(tail.split("(step ", 1)[1].split(",", 1)[0])

        resumed_step = wait_for("trainer resumed from a checkpoint", resumed, timeout_s=300, interval_s=3,
                                diag=lambda: c.logs("trainer-cpu", 80))
        assert resumed_step >= 2, resumed_step  # save_freq 2 and >= 3 steps done before the restart
        wait_for("a step after the resume", lambda: _steps_and_versions(c)[2] > resumed_step,
                 timeout_s=600, interval_s=3, diag=lambda: c.logs("trainer-cpu", 80))
        phases.done(f"trainer restart, resumed from step {resumed_step}")
    except BaseException:
        shared.finished = True  # the next test gets a fresh stack, not a broken one
        print(_diag(c))
        raise
    # 9. ``down -v`` leaves no container or volume of the project: checked when the last test on the
    # stack is done (tests/deploy/cpu_stack.py; normally the chaos test, after this one)
    print(json.dumps(phases.times))
