"""Chaos under a real Docker engine: every service killed mid-run, and nothing lost or trained twice.

The CPU profile (``deploy/docker-compose.yml``) with two rollout replicas trains while seven faults
hit it, one at a time, each where it hurts (``tests/deploy/chaos.py`` says how each is injected):

1. SIGKILL of a rollout replica while it generates (restarted by its policy);
2. SIGKILL of the sandbox with runs in flight;
3. SIGKILL of the reward service while rollouts are graded;
4. SIGKILL of the trainer while it writes a checkpoint (the half-written one is never resumed);
5. SIGKILL of Redis (AOF everysec): clients ride out the restart, vanished jobs are re-issued;
6. a rollout replica off the network for 30 s during weight pushes (skipped within
   ``weight_push_wait_s``, its jobs re-claimed, a full push once back);
7. the sandbox container at its memory limit.

Then the run is finished (its step limit set a few steps ahead, the trainer restarted to read
it) and checked: it reached its step count, the training ledger holds its invariant (every
admitted job trained once or dropped with a reason, never twice, none vanished), every replica is
at the trainer's version, and each fault showed in Prometheus (the target's ``up`` went to 0, or
the matching failure counter rose). Per fault it prints the time to recover and what was redone.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.trainer.ledger import check_file
from tests.deploy import chaos
from tests.deploy.engine import REPO, Compose, Phases, run, wait_for
from tests.deploy.engine import require_engine
from tests.deploy.test_compose_smoke import _free_port, _prepare

pytestmark = pytest.mark.integration
IMAGE = os.environ.get("RETOOL_SMOKE_IMAGE", "retool:cpu")
SERVICES = ["redis", "sandbox", "reward", "prometheus", "rollout-cpu", "trainer-cpu"]
FINAL_EXTRA_STEPS = 4


def _compose(tmp: Path, model: Path, data: Path, run_cfg: Path) -> tuple[Compose, int]:
    prom_port = _free_port()
    env = tmp / "chaos.env"
    env.write_text("\n".join([
        f"RETOOL_IMAGE={IMAGE}", f"MODEL_DIR={model}", f"DATA_DIR={data}",
        f"RETOOL_WEIGHT_TOKEN={secrets.token_hex(16)}", f"GRAFANA_ADMIN_PASSWORD={secrets.token_hex(8)}",
        f"PROMETHEUS_PORT={prom_port}", f"GRAFANA_PORT={_free_port()}", "SANDBOX_MAX_CONCURRENCY=8",
        "TRAINER_CPU_THREADS=1", "TRAINER_NPROC=1", "CHECKPOINT_DIR=checkpoints",
    ]) + "\n")
    prom_cfg = tmp / "prometheus.yml"
    prom_cfg.write_text(chaos.fast_prometheus_config(REPO))
    prom_cfg.chmod(0o644)
    override = tmp / "chaos.override.yml"
    override.write_text(yaml.safe_dump(chaos.chaos_override(run_cfg, prom_cfg)))
    return Compose(f"retool-chaos-{os.getpid()}", env, [REPO / "deploy" / "docker-compose.yml", override]), prom_port


def _diag(c: Compose) -> str:
    return "\n".join(f"--- {s}\n{c.logs(s, 60)[-4000:]}" for s in SERVICES)


VERSIONS = """
import json, socket, urllib.request
ips = sorted({a[4][0] for a in socket.getaddrinfo("rollout", 8000, proto=socket.IPPROTO_TCP)})
print(json.dumps([json.loads(urllib.request.urlopen(f"http://{ip}:8000/healthz", timeout=10).read())
                  ["weight_version"] for ip in ips]))
"""


@pytest.mark.timeout(3600)
def test_every_service_killed_mid_run_loses_nothing_and_trains_nothing_twice(tmp_path_factory):
    require_engine()
    phases = Phases()
    tmp = tmp_path_factory.mktemp("chaos")
    tmp.chmod(0o755)
    run(["env", "DOCKER_BUILDKIT=0", "docker", "build", "--network", "host", "-f", "deploy/docker/Dockerfile",
         "-t", IMAGE, "."], timeout=1800)
    phases.done("build image")
    model, data, run_cfg = _prepare(tmp)
    cfg = chaos.chaos_run_config(yaml.safe_load(run_cfg.read_text()))
    run_cfg.write_text(yaml.safe_dump(cfg))
    phases.done("model and data")
    c, prom_port = _compose(tmp, model, data, run_cfg)
    s = chaos.Stack(c, prom_port)
    results: list[chaos.FaultResult] = []
    try:
        c.cmd("up", "-d", "--no-build", "--scale", f"rollout-cpu={chaos.REPLICAS}", *SERVICES, timeout=900)
        s.wait_steps(0, n=3, timeout=900)
        s.fleet_in_sync()
        phases.done("compose up, 3 steps")

        for fault in (chaos.kill_rollout, chaos.kill_sandbox, chaos.kill_reward, chaos.kill_trainer_in_checkpoint,
                      chaos.kill_redis, lambda st: chaos.cut_rollout_network(st, c.project),
                      chaos.sandbox_memory_limit):
            r = fault(s)
            results.append(r)
            phases.done(f"{r.fault}: recovered in {r.recover_s:.1f} s ({r.redone}; {r.visible}) {r.detail}")

        # finish the run: a step limit a few steps ahead, read by a restarted trainer
        target = s.trainer_step() + FINAL_EXTRA_STEPS
        cfg["max_steps"] = target
        run_cfg.write_text(yaml.safe_dump(cfg))
        since = int(time.time()) - 1
        c.cmd("restart", "trainer-cpu", timeout=300)
        done = wait_for(f"the run to end at step {target}",
                        lambda: chaos._log_after(s, "trainer-cpu", since, "trained to step "), timeout_s=600,
                        interval_s=2, diag=lambda: c.logs("trainer-cpu", 60))
        assert done.startswith(f"trained to step {target}"), done
        c.cmd("stop", "trainer-cpu", timeout=120)
        versions = c.json_from("rollout-cpu", VERSIONS)
        assert versions == [target] * chaos.REPLICAS, versions
        ledger = tmp / "ledger.jsonl"
        run(["docker", "cp", f"{s.container('trainer-cpu')}:/checkpoints/ledger.jsonl", str(ledger)], timeout=60)
        report = check_file(ledger)
        phases.done(f"run ended at step {target}; ledger {json.dumps(report.as_dict())}")
    except BaseException:
        print(_diag(c))
        raise
    finally:
        c.cmd("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)

    sys.__stderr__.write("\n" + chaos.table(results) + "\n")
    assert report.ok, report.violations  # nothing trained twice, nothing vanished silently
    assert report.steps == target and report.ended
    assert report.trained_groups == target * cfg["trainer"]["batch_prompts"]
    assert len(report.resumes) >= 3  # the fresh start, the kill in the checkpoint, the final restart
    seen = {r.fault: r for r in results}
    for r in results:  # each fault showed in Prometheus
        assert r.visible and _visible(r), r
    assert len(seen) == 7


def _visible(r: chaos.FaultResult) -> bool:
    """The fault's trace in Prometheus: an ``up`` at 0, a counter that rose, fewer push targets."""
    v = r.visible
    if "min up{" in v and "=0.0" in v.split(",")[0]:
        return True
    if "min trainer_weight_push_targets=" in v:
        return float(v.split("=", 1)[1]) < chaos.REPLICAS
    return any(part.strip().split("+")[-1].split()[0] not in ("0", "") for part in v.split(",") if "+" in part) \
        or r.redone.get("groups_reclaimed", 0) > 0
