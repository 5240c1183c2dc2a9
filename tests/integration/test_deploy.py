"""Deployment files, validated without a Docker engine (none runs here).

- the compose file is parsed and its security/health structure checked;
- Prometheus config and alert rules pass ``promtool``;
- every alert has promtool unit tests (``promtool test rules``) that pass;
- a real Prometheus scrapes real sandbox, reward and rollout services and a real trainer run
  (``retool trainer run`` in a subprocess: Redis streams fed by a scripted rollout side, real
  FSDP steps, real gRPC weight pushes into the rollout service through a ``dns:`` target), and
  every metric named by a dashboard panel or an alert rule is present in what it scraped;
- the dashboards are exactly what their generator writes; the trainer run configs validate.

What needs a Docker engine is in tests/deploy/test_compose_smoke.py (the CPU profile built,
brought up and driven); GPU reservations are checked only here. The multi-machine override:
test_deploy_multinode.py (as files) and tests/deploy/test_multinode_secure.py (under an engine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.common.config import load_config
from services.common.process import ServiceProcess, free_port
from services.sandbox.launcher import SandboxProcess
from services.sandbox.preflight import CAPABILITIES
from services.trainer.discovery import system_resolver
from services.trainer.loop import RunConfig
from tests.helpers.compose import DRAIN_MARGIN_S, compose_defaults, duration_s, rollout_drain_s
from tests.helpers.tiny_model import tiny_model_dir
from tests.integration.test_trainer_loop import TOKEN, _config, _produce

pytestmark = pytest.mark.integration
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
_PROMQL_WORDS = {
    "sum",
    "by",
    "rate",
    "le",
    "histogram_quantile",
    "clamp_min",
    "max_over_time",
    "deriv",
    "and",
    "or",
    "status",
    "reason",
    "outcome",
    "instance",
    "stream",
    "kind",
    "scalar",
    "increase",
    "delta",
}
GPU_SERVICES = ("rollout", "trainer")
CPU_SERVICES = ("rollout-cpu", "trainer-cpu")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(
            f"{name} not found: install the Debian package 'prometheus' (make test does it as root)"
        )
    return path


def test_every_service_has_a_healthcheck_and_restart_policy():
    expected = {"redis", "sandbox", "reward", "prometheus", "grafana", *GPU_SERVICES, *CPU_SERVICES}
    assert expected <= set(SERVICES)
    for name, svc in SERVICES.items():
        assert "healthcheck" in svc, name
        assert svc.get("restart") == "unless-stopped" or "<<" in str(svc), name


def test_rollout_replicas_get_a_grace_period_past_their_drain():
    """SIGTERM drains a replica for up to redis.drain_s; compose's stop must not SIGKILL it first."""
    for name in ("rollout", "rollout-cpu"):
        svc = SERVICES[name]
        args = [compose_defaults(a) for a in svc["command"]]
        env = {k: compose_defaults(str(v)) for k, v in (svc.get("environment") or {}).items()}
        drain_s = rollout_drain_s(args, env)
        assert duration_s(svc["stop_grace_period"]) >= drain_s + DRAIN_MARGIN_S, (name, drain_s)


def test_depends_on_waits_for_health():
    for name, svc in SERVICES.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, (name, dep)


def test_sandbox_has_no_route_to_redis_the_trainer_or_the_internet():
    nets = COMPOSE["networks"]
    sandbox_nets = set(SERVICES["sandbox"]["networks"])
    assert all(nets[n].get("internal") for n in sandbox_nets), "sandbox network must be internal"
    for other in ("redis", "reward", "trainer", "trainer-cpu", "grafana"):
        assert not sandbox_nets & set(SERVICES[other]["networks"]), other
    # only the callers of the sandbox (rollout) and its scraper share its network
    sharing = {name for name, svc in SERVICES.items() if sandbox_nets & set(svc.get("networks", []))}
    assert sharing == {"sandbox", "rollout", "rollout-cpu", "prometheus"}


def _profiles(name: str) -> list[str]:
    return SERVICES[name].get("profiles", [])


def test_trainer_runs_under_torchrun_with_a_gpu_and_waits_for_healthy_redis_and_rollout():
    for name, rollout in (("trainer", "rollout"), ("trainer-cpu", "rollout-cpu")):
        svc = SERVICES[name]
        assert svc["entrypoint"] == ["torchrun"], name
        args = svc["command"]
        assert any(a.startswith("--nproc-per-node=${TRAINER_NPROC") for a in args), args
        assert args[args.index("-m") : args.index("-m") + 4] == ["-m", "services.cli", "trainer", "run"]
        assert svc["depends_on"] == {
            "redis": {"condition": "service_healthy"},
            rollout: {"condition": "service_healthy"},
        }
        assert "/healthz" in " ".join(svc["healthcheck"]["test"]) and svc["restart"] == "unless-stopped"
        mounts = {re.match(r"^(\$\{[^}]*\}|[^:]+):([^:]+)", v).group(2) for v in svc["volumes"]}
        assert {"/checkpoints", "/data", "/models/policy", "/etc/retool"} <= mounts
        mounted = compose_defaults(args[args.index("--config") + 1])
        config = DEPLOY / "trainer" / mounted.removeprefix("/etc/retool/")
        cfg = load_config(RunConfig, file=config)  # the run config the container uses validates
        assert cfg.metrics_port == 9100 and "9100/healthz" in " ".join(svc["healthcheck"]["test"])
        assert cfg.metrics_host == "0.0.0.0"  # Prometheus scrapes trainer:9100 from its own container
        assert cfg.trainer.checkpoint_dir == "/checkpoints" and cfg.rollout_targets == ["dns:rollout:50051"]
    gpu_args = SERVICES["trainer"]["command"]
    for flag in ("--nnodes=${TRAINER_NNODES", "--node-rank=", "--rdzv-endpoint=${TRAINER_RDZV_ENDPOINT"):
        assert any(a.startswith(flag) for a in gpu_args), flag


def _gpu_reservation(name: str) -> list[str]:
    devices = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
    assert [d["driver"] for d in devices] == ["nvidia"] and all(d["capabilities"] == ["gpu"] for d in devices)
    return [i for d in devices for i in d["device_ids"]]


def test_gpu_profile_reserves_the_configured_gpus_and_the_cpu_profile_none():
    assert _gpu_reservation("rollout") == ["${ROLLOUT_GPUS:-0}"]
    assert _gpu_reservation("trainer") == ["${TRAINER_GPUS:-1}"]
    for name in GPU_SERVICES:
        assert _profiles(name) == ["gpu"] and "cuda" in SERVICES[name]["image"], name
    assert "engine=vllm" in SERVICES["rollout"]["command"]
    for name in CPU_SERVICES:
        svc = SERVICES[name]
        assert _profiles(name) == ["cpu"] and "resources" not in svc.get("deploy", {}), name
        assert "cuda" not in svc["image"] and "cuda" not in svc["build"]["dockerfile"].lower()
    assert "engine=hf" in SERVICES["rollout-cpu"]["command"]
    cpu_cfg = load_config(RunConfig, file=DEPLOY / "trainer" / "tiny-cpu.yaml")
    assert cpu_cfg.trainer.fsdp.backend == "gloo"
    # both variants answer to the same DNS names, so targets and scrape configs are shared
    for gpu, cpu in (("rollout", "rollout-cpu"), ("trainer", "trainer-cpu")):
        for svc in (SERVICES[gpu], SERVICES[cpu]):
            assert all(gpu in n["aliases"] for n in svc["networks"].values()), svc
    # services without a profile never depend on profiled ones (compose would refuse to start)
    for name, svc in SERVICES.items():
        for dep in svc.get("depends_on") or {}:
            assert not _profiles(dep) or set(_profiles(dep)) == set(_profiles(name)), (name, dep)


def test_file_sd_examples_are_well_formed_and_examples_are_not_read():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    for job in cfg["scrape_configs"]:
        (sd,) = job["file_sd_configs"]
        assert sd["files"] == [f"/etc/prometheus/targets/{job['job_name']}*.yml"]  # *.yml.example: no
    mounted = [v for v in SERVICES["prometheus"]["volumes"] if v.endswith(":/etc/prometheus/targets:ro")]
    assert mounted == ["./prometheus/targets:/etc/prometheus/targets:ro"]
    examples = sorted((DEPLOY / "prometheus" / "targets").glob("*.yml.example"))
    assert [p.name for p in examples] == ["rollout.yml.example", "trainer.yml.example"]
    for path in examples:
        for group in yaml.safe_load(path.read_text()):
            assert set(group) <= {"targets", "labels"}, path.name
            assert all(re.fullmatch(r"[\w.\-]+:\d+", t) for t in group["targets"]), path.name


def test_replicas_scale_from_env_and_prometheus_discovers_every_replica():
    for name in ("sandbox", "rollout", "rollout-cpu"):
        assert str(SERVICES[name]["deploy"]["replicas"]).startswith("${"), name
        assert "container_name" not in SERVICES[name] and "ports" not in SERVICES[name], name
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert set(jobs) == {"sandbox", "reward", "rollout", "trainer"}
    assert all("dns_sd_configs" in j for j in jobs.values())
    assert jobs["trainer"]["dns_sd_configs"][0]["port"] == 9100


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_are_multi_stage_pinned_and_run_as_non_root(name):
    text = (DEPLOY / "docker" / name).read_text()
    stages = re.findall(r"^FROM (\S+) AS (\w+)$", text, re.M)
    assert len(stages) >= 2 and stages[-1][1] == "runtime", stages
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    for image, _ in stages:  # every base image has a fixed tag (an ARG default, or a stage)
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        assert base in {s for _, s in stages} or re.search(r":\d[\w.\-]*$", base), base
    assert re.search(r"pip install (--no-deps )?torch==\d+\.\d+\.\d+ ", text)
    runtime = text[text.index(f"AS {stages[-1][1]}") :]
    assert re.search(r"^USER retool$", runtime, re.M) and "useradd --uid 10001" in text
    assert "COPY --from=build /opt/venv /opt/venv" in runtime  # no build tools' venv rebuilt
    assert "install -d -o retool -g retool /checkpoints /runs" in text  # volumes writable
    # compose builds each service from the file its image name says
    built = {svc["build"]["dockerfile"] for svc in SERVICES.values() if "build" in svc}
    assert f"deploy/docker/{name}" in built


def test_sandbox_container_is_hardened():
    sb = SERVICES["sandbox"]
    assert sb["read_only"] is True and sb["cap_drop"] == ["ALL"]
    # exactly what the service's preflight names (services/sandbox/preflight.py)
    assert sorted(sb["cap_add"]) == sorted(CAPABILITIES)
    # its own cgroup namespace: the service mounts a writable cgroup tree rooted at the container
    assert sb["cgroup"] == "private" and sb["init"] is True
    assert "no-new-privileges:true" in sb["security_opt"]
    assert sb["pids_limit"] > 0 and sb["mem_limit"]
    text = (DEPLOY / "docker-compose.yml").read_text()
    for cap in sb["cap_add"]:  # every capability is justified in a comment
        assert re.search(rf"- {cap}\s+# \w", text), cap


def test_uis_are_published_on_loopback_unless_opted_in():
    for name, var in (("prometheus", "PROMETHEUS_BIND"), ("grafana", "GRAFANA_BIND")):
        (spec,) = SERVICES[name]["ports"]
        assert spec.startswith(f"${{{var}:-127.0.0.1}}:"), spec
        assert compose_defaults(spec).startswith("127.0.0.1:"), spec
    published = [n for n, svc in SERVICES.items() if svc.get("ports")]
    assert sorted(published) == ["grafana", "prometheus"]


def test_build_context_leaves_out_virtualenvs_models_and_runs():
    ignore = (DEPLOY.parent / ".dockerignore").read_text().split()
    assert ignore[ignore.index("**") :][:1] == ["**"]  # everything out, then only what the images copy
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    # the project, its lock, and the lock tooling the build runs (docs/install.md)
    assert allowed == {"pyproject.toml", "uv.lock", "README.md", "services", "scripts/uv-requirements.txt",
                       "scripts/check_locks.py"}
    for name in ("Dockerfile", "Dockerfile.cuda"):
        for src in re.findall(r"^COPY (?!--from)(.+) \S+$", (DEPLOY / "docker" / name).read_text(), re.M):
            for path in src.split():
                assert any(path == a or path.startswith(f"{a}/") for a in allowed), (name, path)


def test_redis_is_durable_and_secrets_come_from_env():
    assert (
        "--appendonly" in SERVICES["redis"]["command"] and "redis-data:/data" in SERVICES["redis"]["volumes"]
    )
    env_example = (DEPLOY / ".env.example").read_text()
    for var in (
        "RETOOL_WEIGHT_TOKEN",
        "MODEL_DIR",
        "DATA_DIR",
        "ROLLOUT_GPUS",
        "TRAINER_GPUS",
        "TRAINER_NPROC",
        "SANDBOX_REPLICAS",
        "ROLLOUT_REPLICAS",
        "GRAFANA_ADMIN_PASSWORD",
    ):
        assert f"{var}=" in env_example
    # every variable the compose file interpolates is documented (and set) in the example
    compose_text = "".join(
        (DEPLOY / f).read_text() for f in ("docker-compose.yml", "docker-compose.multinode.yml")
    )
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", compose_text))
    documented = set(re.findall(r"^([A-Z0-9_]+)=", env_example, re.M))
    assert used <= documented, sorted(used - documented)
    assert "RETOOL_WEIGHT_TOKEN" not in str(SERVICES["sandbox"])


def _prometheus_dir(tmp_path: Path, targets: dict[str, str] | None = None) -> Path:
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["rule_files"] = [str(tmp_path / "alerts.yml")]
    if targets is not None:
        # The shipped scrape jobs, with their file_sd half pointed at tmp_path/targets (the
        # multi-machine path, in the format of the shipped *.yml.example files); their
        # dns_sd half needs Docker's DNS and is dropped.
        cfg["global"]["scrape_interval"] = "1s"
        (tmp_path / "targets").mkdir()
        assert {job["job_name"] for job in cfg["scrape_configs"]} == set(targets)
        for job in cfg["scrape_configs"]:
            job.pop("dns_sd_configs")
            (sd,) = job["file_sd_configs"]
            (pattern,) = sd["files"]
            sd["files"] = [str(tmp_path / "targets" / Path(pattern).name)]
            example = yaml.safe_load((DEPLOY / "prometheus" / "targets" / "rollout.yml.example").read_text())
            example[0]["targets"] = [targets[job["job_name"]]]
            (tmp_path / "targets" / f"{job['job_name']}.yml").write_text(yaml.safe_dump(example))
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    shutil.copy(DEPLOY / "prometheus" / "alerts_test.yml", tmp_path / "alerts_test.yml")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    return tmp_path


def test_promtool_accepts_config_and_rules(tmp_path):
    d = _prometheus_dir(tmp_path)
    for args in (
        ["check", "config", str(d / "prometheus.yml")],
        ["check", "rules", str(d / "alerts.yml")],
        ["test", "rules", str(d / "alerts_test.yml")],
    ):
        out = subprocess.run([_tool("promtool"), *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_quiet_promtool_test():
    alerts = {
        r["alert"]
        for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }
    tested: dict[str, set[bool]] = {}
    for case in yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            tested.setdefault(check["alertname"], set()).add(bool(check["exp_alerts"]))
    assert {
        "SandboxErrorRateHigh",
        "SandboxRejectingRequests",
        "GroupsBacklogGrowing",
        "PromptsBacklogGrowing",
        "PolicyStalenessOverLimit",
        "TrainerStepStalled",
        "WeightPushFailing",
    } <= alerts
    for name in alerts:  # promtool runs these cases in test_promtool_accepts_config_and_rules
        assert tested.get(name) == {True, False}, name


def test_dashboards_are_generated_and_valid_json():
    sys.path.insert(0, str(DEPLOY / "grafana"))
    import make_dashboards

    rendered = make_dashboards.render()
    files = {p.name: p.read_text() for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    assert files == rendered, "run: python deploy/grafana/make_dashboards.py"
    assert set(files) == {f"{n}.json" for n in ("sandbox", "reward", "training", "rollout", "queues")}
    for text in files.values():
        board = json.loads(text)
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and all(p["targets"] for p in board["panels"]), board["uid"]


def test_grafana_provisioning_matches_the_dashboards_and_the_compose_mounts():
    prov = DEPLOY / "grafana" / "provisioning"
    (ds,) = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    (provider,) = yaml.safe_load((prov / "dashboards" / "retool.yml").read_text())["providers"]
    binds = [v for v in SERVICES["grafana"]["volumes"] if v.startswith("./")]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in binds)
    assert mounts == {
        "./grafana/provisioning": "/etc/grafana/provisioning",
        "./grafana/dashboards": provider["options"]["path"],
    }
    # the datasource points at the compose service, and every panel/target uses its uid
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    assert "9090" in " ".join(SERVICES["prometheus"]["healthcheck"]["test"])
    for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            refs = [panel["datasource"], *(t["datasource"] for t in panel["targets"])]
            assert all(r == {"type": "prometheus", "uid": ds["uid"]} for r in refs), (path.name, panel["id"])


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b([a-z_][a-z0-9_]*)\b(?=\s*[\[{)]|\s*$|\s*[<>]|\s+and|\s*/)", expr))
    # belt and braces: every service-prefixed identifier, wherever the first pattern misses it
    names |= set(re.findall(r"\b((?:sandbox|reward|rollout|trainer)_[a-z0-9_]+)\b", expr))
    return {n.removesuffix("_bucket") for n in names if n not in _PROMQL_WORDS and "_" in n}


def _queried_metrics() -> set[str]:
    names: set[str] = set()
    for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                names |= _metric_names(target["expr"])
    for group in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            names |= _metric_names(rule["expr"])
    return names


def _start_all(*procs: ServiceProcess) -> None:
    """Start services side by side (each start waits for its /healthz)."""
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        for fut in [pool.submit(p.start) for p in procs]:
            fut.result()


def _trainer_config(tmp_path, model_dir, redis_url: str, grpc_port: int, metrics_port: int):
    # dns: target through the system resolver (the compose form is dns:rollout:50051);
    # "localhost" only where it resolves to the loopback address the replica listens on.
    host = "localhost" if set(system_resolver("localhost")) == {"127.0.0.1"} else "127.0.0.1"
    path = _config(tmp_path, model_dir, redis_url, f"dns:{host}:{grpc_port}", 200)
    cfg = yaml.safe_load(path.read_text())
    cfg["metrics_port"] = metrics_port
    cfg["trainer"]["save_freq"] = 1000
    cfg["trainer"]["total_epochs"] = 100
    # the producer answers 6 steps' jobs; then the trainer idles waiting for groups, /metrics still served
    cfg["group_wait_s"] = 600
    path.write_text(yaml.safe_dump(cfg))
    return path


async def test_real_prometheus_scrapes_every_metric_the_dashboards_and_alerts_use(
    tmp_path, tmp_path_factory, redis_server
):
    queried = _queried_metrics()
    assert {"sandbox_requests_total", "rollout_generated_tokens_total", "trainer_actor_pg_loss"} <= queried
    prefixes = ("sandbox_", "reward_", "rollout_", "trainer_")
    assert all(n.startswith(prefixes) for n in queried), sorted(queried)  # the name parser found only metrics
    model = tiny_model_dir(tmp_path_factory)
    grpc_port, trainer_port = free_port(), free_port()
    sb = SandboxProcess(["--set", "max_concurrency=4", "--set", "zygotes=1", "--set", "light_zygotes=0"])
    rw = ServiceProcess(["reward", "serve", "--set", "workers=1"])
    stop = asyncio.Event()
    producer = prom = trainer = ro = None
    try:
        _start_all(sb, rw)
        ro = ServiceProcess(
            ["rollout", "serve", "--model", str(model), "--grpc-port", str(grpc_port),
             "--sandbox-url", sb.url, "--reward-url", rw.url, "--weight-token-env", "RETOOL_WEIGHT_TOKEN",
             # the Redis worker runs (its metrics are real), on streams of its own: the
             # trainer's groups come from the scripted producer (fast and deterministic)
             "--redis-url", redis_server.url, "--set", "redis.prompts_stream=deploy-test:prompts",
             "--set", "redis.groups_stream=deploy-test:groups"],
            env={"RETOOL_WEIGHT_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
            startup_timeout_s=120,
        )
        # the trainer (torch import, model load) starts while rollout loads its engine
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "trainer", "run",
            "--config", str(_trainer_config(tmp_path, model, redis_server.url, grpc_port, trainer_port)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=(tmp_path / "trainer.log").open("wb"),
            env={**os.environ, "RETOOL_WEIGHT_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
        )
        producer = asyncio.create_task(_produce(redis_server.url, stop, [], [12]))
        await asyncio.to_thread(ro.start)
        async with httpx.AsyncClient(timeout=60) as client:
            await client.post(f"{sb.url}/run_code", json={"code": "print(1)", "language": "python"})
            await client.post(f"{rw.url}/score", json={"response": "Answer: 1", "ground_truth": "1"})
            r = await client.post(
                f"{ro.url}/v1/rollouts",
                json={"prompt_ids": [1, 2, 3], "n": 1, "sampling": {"max_tokens": 8}, "ground_truth": "1"},
            )
            assert r.status_code == 200, r.text
        port = free_port()
        targets = {
            "sandbox": f"127.0.0.1:{sb.port}",
            "reward": f"127.0.0.1:{rw.port}",
            "rollout": f"127.0.0.1:{ro.port}",
            "trainer": f"127.0.0.1:{trainer_port}",
        }
        d = _prometheus_dir(tmp_path, targets)
        prom = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={d / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        api = f"http://127.0.0.1:{port}/api/v1"
        deadline = time.monotonic() + 120
        names: set[str] = set()
        up: list = []
        async with httpx.AsyncClient(timeout=5) as client:
            while time.monotonic() < deadline and trainer.returncode is None:
                try:
                    up = (await client.get(f"{api}/query", params={"query": "up"})).json()["data"]["result"]
                    if len(up) == 4 and all(r["value"][1] == "1" for r in up):
                        got = (await client.get(f"{api}/label/__name__/values")).json()["data"]
                        names = {n.removesuffix("_bucket") for n in got}
                        # the push counter exists from start-up (labels pre-set): wait for a served push
                        pushed = (await client.get(
                            f"{api}/query", params={"query": 'rollout_weight_pushes_total{outcome="ok"} > 0'},
                        )).json()["data"]["result"]
                        if queried <= names and pushed:
                            break
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                await asyncio.sleep(0.5)
            missing = queried - names
            log = (tmp_path / "trainer.log").read_text()[-3000:]
            assert {r["metric"]["job"] for r in up} == set(targets), (up, log)
            assert not missing, f"dashboards/alerts use metrics no service exports: {sorted(missing)}\n{log}"
            rules = (await client.get(f"{api}/rules")).json()["data"]["groups"]
            assert {g["name"] for g in rules} == {"sandbox", "reward", "queues", "trainer"}
            # the trainer's pushes reached the rollout service through the dns: target
            q = "max(rollout_weight_version)"
            version: list = []
            while time.monotonic() < deadline:  # the version gauge may be one scrape behind the counter
                version = (await client.get(f"{api}/query", params={"query": q})).json()["data"]["result"]
                if version and float(version[0]["value"][1]) >= 1:
                    break
                await asyncio.sleep(0.5)
            assert version and float(version[0]["value"][1]) >= 1, (version, log)
            health = (await client.get(f"http://127.0.0.1:{trainer_port}/healthz")).json()
            assert health["status"] == "ok" and health["step"] >= 1
    finally:
        stop.set()
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        if trainer is not None and trainer.returncode is None:
            trainer.kill()
            await trainer.wait()
        if producer is not None:
            await producer
        for proc in (ro, rw, sb):
            if proc is not None:
                proc.stop()
