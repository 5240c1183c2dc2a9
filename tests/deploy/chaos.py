"""Faults for the chaos test and ``bench/chaos.py``: the CPU compose stack, hit while it trains.

Each fault is injected where it hurts and then waited out (a condition with a deadline, never a
sleep that is assumed long enough): the faulted part is back (healthy, at the trainer's weight
version) and the trainer made ``PROGRESS_STEPS`` more steps. Each returns a ``FaultResult``: the
seconds to recover and what was redone (groups re-claimed by a replica, jobs re-issued,
steps repeated after a resume), measured from the services' own counters.

How faults are injected:
- a container "crash" is a SIGKILL of its main process from the host (``State.Pid``); a plain
  ``docker kill`` counts as a manual stop for Docker, whose restart policy then leaves the
  container down, while a process that dies is restarted by ``restart: unless-stopped``, as an
  OOM kill or a crash would be;
- the trainer is killed while it writes a checkpoint: ``RETOOL_FAULT_CHECKPOINT_HOLD_FILE``
  (services/trainer/checkpoint.py) names a file in the trainer's ``/dev/shm`` (a fresh tmpfs on
  every container start, so the restarted trainer does not hold again); while it exists, the
  checkpoint waits half-written, and the SIGKILL lands there;
- a drain is ``docker stop`` of one rollout replica (SIGTERM, as ``docker compose stop`` and
  Kubernetes send, then SIGKILL after the grace period): it must exit 0 before that, having handed
  its jobs back; then ``docker start`` (a stopped container is not restarted by its policy);
- the network fault disconnects a rollout replica from both its networks for ``NET_CUT_S`` and
  connects it again with its compose aliases;
- the sandbox's memory fault runs many memory-hungry runs at once in a sandbox container whose
  memory limit is below their sum (the per-run cgroups admit each one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.trainer.ledger import LedgerReport, check_file
from tests.deploy import chaos_inflight as inflight
from tests.deploy.engine import REPO, Compose, run, wait_for, write_compose_env
from tests.helpers.ledger_witness import StreamWitness, witness_of

REPLICAS = 2
PROGRESS_STEPS = 2
NET_CUT_S = 30.0
HOLD_FILE = "/dev/shm/retool-chaos-hold"
SANDBOX_MEM_LIMIT = "1536m"
PUSH_WAIT_S = 10.0
RECOVER_S = 420.0
DRAIN_GRACE_S = 60  # deploy/docker-compose.yml: stop_grace_period of the rollout replicas


@dataclass
class FaultResult:
    fault: str
    recover_s: float
    visible: str = ""
    seen: bool = False  # the fault showed in Prometheus (an up at 0, a counter that rose)
    trainer_restarts: int = 0  # of the trainer container while the fault was injected and recovered
    redone: dict[str, float] = field(default_factory=dict)
    detail: str = ""


def chaos_run_config(base: dict[str, Any]) -> dict[str, Any]:
    """The smoke test's run config, made for faults: short pushes to a lost replica, frequent
    checks for vanished jobs, a checkpoint every 2 steps, no step limit but the data's."""
    cfg = dict(base)
    cfg.update(weight_push_wait_s=PUSH_WAIT_S, reissue_check_s=10.0, max_steps=100_000)
    cfg["trainer"] = {**cfg["trainer"], "save_freq": 2, "keep_last_checkpoints": 3}
    return cfg


def chaos_override(run_cfg: Path, prometheus_cfg: Path) -> dict[str, Any]:
    """Compose override: the run config, quick re-claims, the checkpoint hold, a small sandbox
    memory limit, and a Prometheus that scrapes every 2 s (a restart of a few seconds shows)."""
    return {"services": {
        "trainer-cpu": {"volumes": [f"{run_cfg}:/etc/retool/tiny-cpu.yaml:ro"],
                        "environment": {"RETOOL_FAULT_CHECKPOINT_HOLD_FILE": HOLD_FILE}},
        "rollout-cpu": {"environment": {"OMP_NUM_THREADS": "1",
                                        "RETOOL_ROLLOUT__REDIS__CLAIM_IDLE_MS": "15000",
                                        "RETOOL_ROLLOUT__REDIS__HEARTBEAT_MS": "3000",
                                        "RETOOL_ROLLOUT__REDIS__MAX_DELIVERIES": "20"}},
        "sandbox": {"mem_limit": SANDBOX_MEM_LIMIT},
        "prometheus": {"volumes": [f"{prometheus_cfg}:/etc/prometheus/prometheus.yml:ro"]},
    }}


def fast_prometheus_config(repo: Path) -> str:
    cfg = yaml.safe_load((repo / "deploy" / "prometheus" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "2s"
    for job in cfg["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            sd["refresh_interval"] = "2s"
    return yaml.safe_dump(cfg)


SERVICES = ["redis", "sandbox", "reward", "prometheus", "rollout-cpu", "trainer-cpu"]


class Stack:
    """One compose project of the CPU profile: bring-up, probes, the end of the run, tear-down."""

    def __init__(self, c: Compose, prometheus_port: int, tmp: Path, cfg: dict[str, Any],
                 run_cfg: Path) -> None:
        self.c = c
        self.prom_port = prometheus_port
        self.tmp = tmp
        self.cfg = cfg
        self.run_cfg = run_cfg

    @classmethod
    def prepare(cls, tmp: Path, image: str, project: str) -> Stack:
        """Model (init-tiny + a short SFT), data, run config, env file and override under ``tmp``."""
        from tests.deploy.test_compose_smoke import TRAINER_ENV, _prepare

        model, data, run_cfg = _prepare(tmp)
        cfg = chaos_run_config(yaml.safe_load(run_cfg.read_text()))
        run_cfg.write_text(yaml.safe_dump(cfg))
        env = tmp / "chaos.env"
        prom_port = write_compose_env(env, image=image, model=model, data=data, sandbox_concurrency=8,
                                      extra=TRAINER_ENV)
        prom_cfg = tmp / "prometheus.yml"
        prom_cfg.write_text(fast_prometheus_config(REPO))
        prom_cfg.chmod(0o644)
        override = tmp / "chaos.override.yml"
        override.write_text(yaml.safe_dump(chaos_override(run_cfg, prom_cfg)))
        c = Compose(project, env, [REPO / "deploy" / "docker-compose.yml", override])
        return cls(c, prom_port, tmp, cfg, run_cfg)

    def up(self) -> None:
        """``compose up`` with REPLICAS rollout replicas; returns once 3 steps reached every replica."""
        self.start()
        self.settled()

    def start(self, services: list[str] = SERVICES) -> None:
        """``compose up -d`` of ``services`` with REPLICAS rollout replicas (tests/deploy/cpu_stack.py
        shares one such stack between the compose smoke test and the chaos test)."""
        self.c.cmd("up", "-d", "--no-build", "--scale", f"rollout-cpu={REPLICAS}", *services, timeout=900)

    def settled(self) -> None:
        """Returns once the trainer made 3 steps and every replica is at its version."""
        self.wait_steps(0, n=3, timeout=900)
        self.fleet_in_sync()

    def finish(self, extra_steps: int) -> tuple[int, list[int], LedgerReport]:
        """End the run ``extra_steps`` ahead (the limit is read by a restarted trainer); returns the
        final step, every replica's weight version and the ledger's check."""
        target = self.trainer_step() + extra_steps
        self.cfg["max_steps"] = target
        self.run_cfg.write_text(yaml.safe_dump(self.cfg))
        since = int(time.time()) - 1
        self.c.cmd("restart", "trainer-cpu", timeout=300)
        wait_for(f"the run to end at step {target}",  # (the stop before the restart prints an earlier step)
                 lambda: _log_after(self, "trainer-cpu", since, f"trained to step {target}\n"), timeout_s=600,
                 interval_s=2, diag=lambda: self.c.logs("trainer-cpu", 60))
        self.c.cmd("stop", "trainer-cpu", timeout=120)
        versions = self.c.json_from("rollout-cpu", VERSIONS)
        ledger = self.tmp / "ledger.jsonl"
        run(["docker", "cp", f"{self.container('trainer-cpu')}:/checkpoints/ledger.jsonl", str(ledger)],
            timeout=60)
        self.ledger_file = ledger
        # the ledger's second witness: what Redis shows of the groups stream (tests/helpers/ledger_witness.py)
        self.groups_witness = self.stream_witness(self.cfg.get("groups_stream", "retool:groups"),
                                                  self.cfg.get("consumer_group", "trainer"))
        return target, versions, check_file(ledger)  # type: ignore[return-value]

    def diag(self) -> str:
        return "\n".join(f"--- {s}\n{self.c.logs(s, 60)[-4000:]}" for s in SERVICES)

    def down(self) -> None:
        self.c.cmd("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)

    # ---- probes ------------------------------------------------------------------------------
    def stream_witness(self, stream: str, group: str) -> StreamWitness:
        """``XINFO STREAM`` / ``XINFO GROUPS`` of ``stream``, read with redis-cli in the redis container."""
        name = self.container("redis")

        def xinfo(*args: str) -> Any:
            # XINFO STREAM carries the first and last entries, whose msgpack payloads redis-cli prints
            # as raw bytes: read bytes, and let what is not UTF-8 stand as U+FFFD (only counts are used)
            proc = subprocess.run(["docker", "exec", name, "redis-cli", "--json", "XINFO", *args, stream],
                                  capture_output=True, timeout=60, check=True)
            return json.loads(proc.stdout.decode("utf-8", errors="replace"))

        return witness_of(xinfo("STREAM"), xinfo("GROUPS"), group)

    def container(self, service: str, index: int = 1) -> str:
        for x in self.c.containers():
            if x.get("Service") == service and int(x.get("Name", "x-0").rsplit("-", 1)[1]) == index:
                return str(x["Name"])
        names = [x.get("Name") for x in self.c.containers()]
        raise AssertionError(f"no container {service}#{index}: {names}")

    def inspect(self, name: str, fmt: str) -> Any:
        out = run(["docker", "inspect", "--format", f"{{{{json {fmt}}}}}", name], timeout=60).stdout
        return json.loads(out)

    def running(self, name: str) -> bool:
        state = self.inspect(name, ".State")
        health = (state.get("Health") or {}).get("Status")
        return bool(state.get("Running")) and health in (None, "healthy")

    def restarts(self, name: str) -> int:
        return int(self.inspect(name, ".RestartCount"))

    def probe(self, code: str, service: str = "rollout-cpu", timeout: float = 60) -> Any:
        """Run ``code`` in a healthy container of ``service`` and return its last stdout line as JSON."""
        for index in range(1, REPLICAS + 1 if service == "rollout-cpu" else 2):
            p = self.c.python(service, code, index=index, timeout=timeout, check=False)
            lines = p.stdout.strip().splitlines()
            if p.returncode == 0 and lines:
                return json.loads(lines[-1])
        raise AssertionError(f"no {service} container answered the probe: {p.stderr[-500:]}")

    def fleet(self) -> dict[str, Any]:
        """Trainer step (its /healthz) and every rollout replica's weight version (by DNS)."""
        return self.probe(FLEET_PROBE)

    def trainer_step(self) -> int:
        return int(self.fleet()["step"])

    def metric(self, service: str, index: int, name: str, port: int) -> float:
        """The sum of a metric's series, read from the container's own /metrics."""
        code = (f"import urllib.request, json; t = urllib.request.urlopen('http://127.0.0.1:{port}/metrics', "
                "timeout=10).read().decode()\n"
                f"print(json.dumps(sum(float(l.rsplit(' ', 1)[1]) for l in t.splitlines() "
                f"if l.startswith({name!r}) and not l.startswith('#'))))")
        return float(self.c.json_from(service, code, index=index, timeout=60))  # type: ignore[arg-type]

    def prom(self, query: str) -> float | None:
        q = urllib.parse.quote(query)
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/query?query={q}"
        with urllib.request.urlopen(url, timeout=10) as r:
            res = json.loads(r.read())["data"]["result"]
        return float(res[0]["value"][1]) if res else None

    def prom_sum(self, metric: str, window_s: float, fn: str = "increase") -> float:
        return self.prom(f"sum({fn}({metric}[{int(window_s) + 5}s]))") or 0.0

    def wait_steps(self, after: int, n: int = PROGRESS_STEPS, timeout: float = RECOVER_S) -> int:
        return int(wait_for(f"trainer step >= {after + n}", lambda: (s := self._step_or_none()) is not None
                            and s >= after + n and s, timeout_s=timeout, interval_s=2,
                            diag=lambda: self.c.logs("trainer-cpu", 60)))

    def _step_or_none(self) -> int | None:
        try:
            return self.trainer_step()
        except (AssertionError, subprocess.SubprocessError, ValueError, KeyError):
            return None

    def fleet_in_sync(self, timeout: float = RECOVER_S) -> dict[str, Any]:
        """Every replica answers and is at the trainer's version (one probe: step, versions, step)."""
        def ok() -> dict[str, Any] | None:
            f = self.fleet()
            return f if (f["before"] == f["step"] and len(f["versions"]) == REPLICAS
                         and all(v == f["step"] for v in f["versions"])) else None
        return wait_for("every replica at the trainer's version", ok, timeout_s=timeout, interval_s=2,
                        diag=lambda: self.c.logs("trainer-cpu", 40))

    # ---- injection ---------------------------------------------------------------------------
    def sigkill(self, name: str) -> None:
        """SIGKILL the container's main process from the host: a crash its restart policy sees."""
        pid = int(self.inspect(name, ".State.Pid"))
        if pid <= 0 or not Path(f"/proc/{pid}").exists():
            raise AssertionError(f"{name}: its main process (pid {pid}) is not visible from here; the "
                                 "chaos test needs the Docker engine on this machine")
        os.kill(pid, signal.SIGKILL)

    def wait_restarted(self, name: str, restarts_before: int, *, healthy: bool = True) -> None:
        """Restarted by its policy (and healthy, unless ``healthy=False``: the trainer's health check
        runs every 15 s; its recovery is measured by its steps)."""
        def back() -> bool:
            if self.restarts(name) <= restarts_before:
                return False
            return self.running(name) if healthy else bool(self.inspect(name, ".State.Running"))
        wait_for(f"{name} restarted" + (" and healthy" if healthy else ""), back, timeout_s=RECOVER_S,
                 interval_s=1)


FLEET_PROBE = """
import json, socket, urllib.request
def get(url):
    return json.loads(urllib.request.urlopen(url, timeout=10).read())
ips = sorted({a[4][0] for a in socket.getaddrinfo("rollout", 8000, proto=socket.IPPROTO_TCP)})
before = get("http://trainer:9100/healthz")["step"]
versions = []
for ip in ips:
    try:
        versions.append(get(f"http://{ip}:8000/healthz")["weight_version"])
    except Exception:
        versions.append(None)
step = get("http://trainer:9100/healthz")["step"]
print(json.dumps({"before": before, "versions": versions, "step": step}))
"""

VERSIONS = """
import json, socket, urllib.request
ips = sorted({a[4][0] for a in socket.getaddrinfo("rollout", 8000, proto=socket.IPPROTO_TCP)})
print(json.dumps([json.loads(urllib.request.urlopen(f"http://{ip}:8000/healthz", timeout=10).read())
                  ["weight_version"] for ip in ips]))
"""

# A long tool run in flight in the sandbox (sent from a rollout container, as rollout sends it).
SLEEPING_RUN = ("import json, urllib.request\n"
                "body = json.dumps({'code': 'import time; time.sleep(60)', 'language': 'python', "
                "'run_timeout': 90}).encode()\n"
                "req = urllib.request.Request('http://sandbox:8080/run_code', data=body, "
                "headers={'content-type': 'application/json'})\n"
                "try:\n    print(urllib.request.urlopen(req, timeout=120).read().decode()[:200])\n"
                "except Exception as exc:\n    print(type(exc).__name__)\n")

MEMORY_FLOOD = """
import json, threading, urllib.request
CODE = ("x = bytearray({mb} * 2**20)\\nfor i in range(0, len(x), 4096):\\n    x[i] = 1\\n"
        "import time; time.sleep(8)\\nprint('held')")
out = []
def one():
    body = json.dumps({{"code": CODE, "language": "python", "run_timeout": 60,
                        "memory_limit_MB": {limit}}}).encode()
    req = urllib.request.Request("http://sandbox:8080/run_code", data=body,
                                 headers={{"content-type": "application/json"}})
    try:
        r = json.loads(urllib.request.urlopen(req, timeout=120).read())
        out.append((r.get("status"), (r.get("run_result") or {{}}).get("status")))
    except Exception as exc:
        out.append(("error", type(exc).__name__))
ts = [threading.Thread(target=one) for _ in range({n})]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps(out))
"""


def _background(fn: Callable[[], Any]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


# ---- the faults --------------------------------------------------------------------------------
def kill_rollout(s: Stack) -> FaultResult:
    """1. SIGKILL of rollout replica 1 while it holds a job with a turn checkpoint (so there is work in
    flight to continue: the replica is frozen with ``docker pause`` while Redis is read, and thawed
    again when it holds none); restarted by its policy."""
    name = s.container("rollout-cpu", 1)

    def frozen_holding_a_checkpointed_job() -> str | None:
        if s.metric("rollout-cpu", 1, "rollout_worker_jobs_in_flight", 8000) <= 0:
            return None
        run(["docker", "pause", name], timeout=60)
        job = None
        try:
            job = inflight.checkpointed_job_held(s, name)
        finally:
            if job is None:
                run(["docker", "unpause", name], timeout=60)
        return job

    job = wait_for("replica 1 holding a job with a turn checkpoint", frozen_holding_a_checkpointed_job,
                   timeout_s=300, interval_s=0.2)
    reclaimed0 = s.metric("rollout-cpu", 2, 'rollout_worker_jobs{outcome="reclaimed"}', 8000)
    other0 = inflight.rollout_counters(s, 2)
    step0, r0, t0 = s.trainer_step(), s.restarts(name), time.monotonic()
    s.sigkill(name)  # pending while frozen: it lands as the container thaws, before any more work
    run(["docker", "unpause", name], timeout=60, check=False)
    s.wait_restarted(name, r0)
    s.fleet_in_sync()
    s.wait_steps(step0)
    # its job continues on the restarted replica at once (the same consumer name) or on any replica
    # after claim_idle_ms; the group's publication deletes the job's checkpoints
    wait_for(f"job {job} continued and published", lambda: inflight.checkpoint_gone(s, job),
             timeout_s=RECOVER_S, interval_s=1)
    took = time.monotonic() - t0
    reclaimed = s.metric("rollout-cpu", 2, 'rollout_worker_jobs{outcome="reclaimed"}', 8000) - reclaimed0
    fleet = inflight.fleet_delta(s, 1, 2, other0)
    try:
        continued = inflight.check_kill_regenerated(fleet, int(s.cfg["sampling"]["max_tokens"]))
    except AssertionError as exc:  # say what became of the job the replica held
        logs = {}
        for i in (1, 2):
            p = run(["docker", "logs", s.container("rollout-cpu", i)], timeout=60, check=False)
            logs[i] = [line for line in (p.stdout + p.stderr).splitlines() if job in line]
        raise AssertionError(f"{exc}\njob {job} in the replicas' logs: {logs}") from None
    window = int(took) + 10
    up0 = s.prom(f'min_over_time(up{{job="rollout"}}[{window}s])')
    restarted = s.prom_sum("rollout_start_time_seconds", window, fn="changes")
    return FaultResult("rollout SIGKILL while generating", took, seen=up0 == 0 or restarted > 0,
                       visible=f"min up{{job=rollout}}={up0}, "
                               f"rollout_start_time_seconds changes +{restarted:.0f}",
                       redone={"groups_reclaimed": reclaimed,
                               "tokens_regenerated": fleet[inflight.REGENERATED]},
                       detail=f"killed holding job {job} (checkpointed), which the restarted replica "
                              "or the other one (after claim_idle_ms) continued; " + continued)


def drain_rollout(s: Stack) -> FaultResult:
    """8. SIGTERM (a drain) of rollout replica 1 while it generates: it takes no job, lets the running
    ones reach a turn boundary (at most redis.drain_s), hands every job back and exits 0 within the
    grace period; the other replica takes them at once; started again."""
    name = s.container("rollout-cpu", 1)
    wait_for("replica 1 generating",
             lambda: s.metric("rollout-cpu", 1, "rollout_worker_jobs_in_flight", 8000) > 0,
             timeout_s=120, interval_s=0.5)
    other0 = inflight.rollout_counters(s, 2)
    step0, t0, since = s.trainer_step(), time.monotonic(), int(time.time()) - 1
    run(["docker", "stop", "--time", str(DRAIN_GRACE_S), name], timeout=DRAIN_GRACE_S + 60)
    stopped_s = time.monotonic() - t0
    exit_code = int(s.inspect(name, ".State.ExitCode"))
    assert exit_code == 0, f"{name} exited {exit_code} on SIGTERM (137: killed at the grace period)"
    handed = inflight.handed_back_in_logs(name, since)
    run(["docker", "start", name], timeout=120)
    wait_for(f"{name} healthy again", lambda: s.running(name), timeout_s=RECOVER_S, interval_s=1)
    s.fleet_in_sync()
    s.wait_steps(step0)
    # each handed-back job is taken by a replica's next loop turn (handback.py): wait for them all
    taken = (inflight.TAKEN_OVER, inflight.RECLAIMED)
    wait_for(f"{handed} handed-back jobs taken", lambda: handed == 0 or sum(
        inflight.fleet_delta(s, 1, 2, other0)[k] for k in taken) >= handed, timeout_s=120, interval_s=2)
    took = time.monotonic() - t0
    fleet = inflight.fleet_delta(s, 1, 2, other0)
    detail = "; ".join((f"stopped (exit 0) in {stopped_s:.1f} s",
                        inflight.check_drain_regenerated_nothing(fleet),
                        inflight.check_drain_pickup(fleet, handed)))
    window = int(took) + 10
    up0 = s.prom(f'min_over_time(up{{job="rollout"}}[{window}s])')
    draining = s.prom(f"max_over_time(rollout_draining[{window}s])")
    restarted = s.prom_sum("rollout_start_time_seconds", window, fn="changes")  # a drain may be too quick
    return FaultResult("rollout SIGTERM (drain) while generating", took,  # for a 2 s scrape to see
                       seen=up0 == 0 or draining == 1 or restarted > 0,
                       visible=f"min up{{job=rollout}}={up0}, max rollout_draining={draining}, "
                               f"rollout_start_time_seconds changes +{restarted:.0f}",
                       redone={"jobs_handed_back": handed, "tokens_regenerated": fleet[inflight.REGENERATED]},
                       detail=detail)


def kill_sandbox(s: Stack) -> FaultResult:
    """2. SIGKILL of the sandbox container with runs in flight (two of our own, long, plus the
    training's): tool calls retry (counted) and ride it out or fail their group loudly."""
    for _ in range(2):
        _background(lambda: s.c.python("rollout-cpu", SLEEPING_RUN, index=2, timeout=150, check=False))
    wait_for("runs in flight in the sandbox",
             lambda: s.metric("sandbox", 1, "sandbox_executions_in_flight", 8080) >= 2, timeout_s=60,
             interval_s=0.5)
    return _kill_a_rollout_dependency(s, "sandbox", "sandbox SIGKILL with runs in flight")


def kill_reward(s: Stack) -> FaultResult:
    """3. SIGKILL of the reward container while rollouts are being graded."""
    return _kill_a_rollout_dependency(s, "reward", "reward SIGKILL while grading")


def _kill_a_rollout_dependency(s: Stack, service: str, label: str) -> FaultResult:
    """SIGKILL ``service`` (sandbox or reward), wait for its restart and two more trainer steps;
    seen when its ``up`` went to 0 or the replicas' retries towards it rose."""
    name = s.container(service)
    step0, r0, t0 = s.trainer_step(), s.restarts(name), time.monotonic()
    s.sigkill(name)
    s.wait_restarted(name, r0)
    s.wait_steps(step0)
    took = time.monotonic() - t0
    window = took + 10
    retries = s.prom_sum(f'rollout_retries_total{{target="{service}"}}', window)
    failed = s.prom_sum('rollout_worker_jobs{outcome="failed"}', window, fn="delta")
    up0 = s.prom(f'min_over_time(up{{job="{service}"}}[{int(window)}s])')
    return FaultResult(label, took, seen=up0 == 0 or retries > 0,
                       visible=f"min up{{job={service}}}={up0}, {service} retries +{retries:.0f}",
                       redone={"jobs_failed_and_retried": failed})


def kill_trainer_in_checkpoint(s: Stack) -> FaultResult:
    """4. SIGKILL of the trainer while it writes a checkpoint; it resumes from the previous one."""
    name = s.container("trainer-cpu")
    r0 = s.restarts(name)
    since = int(time.time()) - 1
    s.c.cmd("exec", "-T", "trainer-cpu", "touch", HOLD_FILE, timeout=60)
    held = wait_for("the trainer holding a half-written checkpoint",
                    lambda: _log_after(s, "trainer-cpu", since, "checkpoint hold: step "),
                    timeout_s=RECOVER_S, interval_s=0.5)
    held_step = int(held.split("checkpoint hold: step ", 1)[1].split()[0])
    t0 = time.monotonic()
    s.sigkill(name)
    s.wait_restarted(name, r0, healthy=False)
    resumed = wait_for("the trainer resumed", lambda: _log_after(s, "trainer-cpu", since, "resumed from "),
                       timeout_s=RECOVER_S, interval_s=1)
    resumed_step = int(resumed.split("(step ", 1)[1].split(",", 1)[0])
    assert resumed_step < held_step, (resumed_step, held_step)  # never the half-written one
    s.wait_steps(held_step)
    took = time.monotonic() - t0
    up0 = s.prom(f'min_over_time(up{{job="trainer"}}[{int(took) + 10}s])')
    return FaultResult("trainer SIGKILL while writing a checkpoint", took, seen=up0 == 0,
                       visible=f"min up{{job=trainer}}={up0}",
                       redone={"steps_repeated": held_step - resumed_step},
                       detail=f"held at step {held_step}, resumed from step {resumed_step}")


def kill_redis(s: Stack) -> FaultResult:
    """5. SIGKILL of Redis (AOF everysec): clients ride out the restart; lost jobs are re-issued."""
    name = s.container("redis")
    step0, r0, t0 = s.trainer_step(), s.restarts(name), time.monotonic()
    s.sigkill(name)
    s.wait_restarted(name, r0)
    s.wait_steps(step0)
    took = time.monotonic() - t0
    window = took + 10
    trainer_errors = s.prom_sum("trainer_redis_connection_errors_total", window)
    rollout_errors = s.prom_sum('rollout_retries_total{target="redis"}', window)
    reissued = s.prom_sum("trainer_jobs_reissued_total", window + 60)
    return FaultResult("redis SIGKILL (AOF everysec)", took, seen=trainer_errors + rollout_errors > 0,
                       visible=f"redis connection errors: trainer +{trainer_errors:.0f}, "
                               f"rollout +{rollout_errors:.0f}",
                       redone={"jobs_reissued": reissued})


def cut_rollout_network(s: Stack) -> FaultResult:
    """6. Rollout replica 2 cut off from both networks for NET_CUT_S during weight pushes: skipped
    within weight_push_wait_s; its jobs re-claimed by replica 1; a full push once it is back."""
    name = s.container("rollout-cpu", 2)
    nets = list(s.inspect(name, ".NetworkSettings.Networks"))
    wait_for("replica 2 generating",
             lambda: s.metric("rollout-cpu", 2, "rollout_worker_jobs_in_flight", 8000) > 0,
             timeout_s=120, interval_s=0.5)
    reclaimed0 = s.metric("rollout-cpu", 1, 'rollout_worker_jobs{outcome="reclaimed"}', 8000)
    done0 = s.metric("rollout-cpu", 2, 'rollout_worker_jobs{outcome="done"}', 8000)
    step0, t0 = s.trainer_step(), time.monotonic()
    for net in nets:
        run(["docker", "network", "disconnect", net, name], timeout=60)
    try:
        s.wait_steps(step0, n=3)  # the trainer goes on without it
        while time.monotonic() - t0 < NET_CUT_S:
            time.sleep(0.5)
    finally:
        for net in nets:
            run(["docker", "network", "connect", "--alias", "rollout", "--alias", "rollout-cpu", net, name],
                timeout=60)
    s.fleet_in_sync()
    # back at work, not only back on the network: its Redis connections died with the cut
    wait_for("replica 2 finishing jobs again",
             lambda: s.metric("rollout-cpu", 2, 'rollout_worker_jobs{outcome="done"}', 8000) > done0,
             timeout_s=RECOVER_S, interval_s=1, diag=lambda: s.c.logs("rollout-cpu", 60))
    s.wait_steps(s.trainer_step())
    took = time.monotonic() - t0
    reclaimed = s.metric("rollout-cpu", 1, 'rollout_worker_jobs{outcome="reclaimed"}', 8000) - reclaimed0
    min_targets = s.prom(f"min_over_time(trainer_weight_push_targets[{int(took) + 10}s])")
    return FaultResult(f"rollout replica off the network {NET_CUT_S:.0f} s", took,
                       seen=min_targets is not None and min_targets < REPLICAS,
                       visible=f"min trainer_weight_push_targets={min_targets}",
                       redone={"groups_reclaimed": reclaimed},
                       detail=f"trainer stepped {step0} -> {step0 + 3}+ while it was cut off")


def sandbox_memory_limit(s: Stack, runs: int = 8, mb: int = 300) -> FaultResult:
    """7. The sandbox container at its memory limit: ``runs`` runs of ``mb`` MB each at once (each
    within its own cgroup's limit, together past the container's)."""
    name = s.container("sandbox")
    r0 = s.restarts(name)
    oom0 = _oom_events(s)
    step0, t0 = s.trainer_step(), time.monotonic()
    out = s.probe(MEMORY_FLOOD.format(mb=mb, limit=mb + 128, n=runs), timeout=300)
    wait_for("sandbox healthy", lambda: s.running(name), timeout_s=RECOVER_S, interval_s=1)
    s.wait_steps(step0)
    took = time.monotonic() - t0
    held = sum(1 for st, rs in out if st == "Success")
    failed = len(out) - held
    window = took + 10
    bad = s.prom_sum('sandbox_requests_total{status!="Success"}', window)
    restarts, ooms = s.restarts(name) - r0, _oom_events(s) - oom0
    return FaultResult("sandbox container at its memory limit", took, seen=bad > 0 or restarts > 0,
                       visible=f"sandbox non-success runs +{bad:.0f}, container restarts {restarts}, "
                               f"memcg OOM kills +{ooms}",
                       redone={"runs_failed": failed},
                       detail=f"{held}/{len(out)} runs held {mb} MB; results {out}")


def inject(s: Stack, fault: Callable[[Stack], FaultResult]) -> FaultResult:
    """Run one fault and count the trainer's restarts meanwhile (only its own fault may restart it)."""
    trainer = s.container("trainer-cpu")
    r0 = s.restarts(trainer)
    r = fault(s)
    r.trainer_restarts = s.restarts(trainer) - r0
    if r.trainer_restarts and not fault.__name__.startswith("kill_trainer"):
        # an unplanned trainer restart: keep why it stopped (the stack is gone by the report)
        lines = s.c.logs("trainer-cpu", 1500).splitlines()
        why = [x for x in lines if any(k in x for k in ("Error", "error", "Traceback", "failed", "warning"))]
        r.detail += "\ntrainer log before the restart (errors and warnings):\n" + "\n".join(why[-60:])
    return r


def _oom_events(s: Stack) -> int:
    """OOM kills counted by the sandbox container's memory cgroup (v2 memory.events; v1: -1)."""
    p = s.c.cmd("exec", "-T", "sandbox", "sh", "-c",
                "cat /sys/fs/cgroup/memory.events 2>/dev/null || true", timeout=60, check=False)
    for line in p.stdout.splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return -1


def _log_after(s: Stack, service: str, since: int, marker: str) -> str | None:
    p = s.c.cmd("logs", "--no-color", "--since", str(since), service, timeout=60, check=False)
    text = p.stdout + p.stderr
    if marker not in text:
        return None
    return text[text.rindex(marker):][:300]


def table(results: list[FaultResult]) -> str:
    rows = ["| fault | time to recover (s) | what was redone | seen in Prometheus |",
            "| --- | --- | --- | --- |"]
    for r in results:
        redone = ", ".join(f"{k} {v:g}" for k, v in r.redone.items()) or "-"
        rows.append(f"| {r.fault} | {r.recover_s:.1f} | {redone} | {r.visible} |")
    return "\n".join(rows)


FAULTS: tuple[Callable[[Stack], FaultResult], ...] = (
    kill_rollout, kill_sandbox, kill_reward, kill_trainer_in_checkpoint, kill_redis, cut_rollout_network,
    sandbox_memory_limit, drain_rollout,
)
