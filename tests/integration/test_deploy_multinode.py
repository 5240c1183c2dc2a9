"""deploy/docker-compose.multinode.yml as files: merged onto docker-compose.yml by Compose's rules
(``!reset`` / ``!override``), it must be secure by default and change only what crossing machines
needs. Under a real engine: tests/deploy/test_multinode_secure.py.

- the trainer on the host network, only Redis and rollout published (on NODE_ADDR, network ``nodes``);
- every server requires its token, Redis serves TLS only with the ACL, the push is mutual TLS, every
  client is given its credentials; every ``/run/secrets/<name>`` an environment names is a secret of
  that service, and every secret file is one that ``retool secrets init`` writes;
- the sandbox only gains its token's hash; prometheus.secure.yml differs from prometheus.yml in the
  rollout job's HTTPS alone; the multi-machine run config validates and uses the published ports.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from services.common.config import load_config
from services.stack.secrets import init_secrets
from services.trainer.loop import RunConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


class _Tagged:
    def __init__(self, tag: str, value: object) -> None:
        self.tag, self.value = tag, value


class _ComposeLoader(yaml.SafeLoader):
    """Compose's merge tags (>= 2.24.4): ``!reset`` drops a key, ``!override`` replaces it."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Tagged("reset", None))
_ComposeLoader.add_constructor(
    "!override", lambda loader, node: _Tagged("override", loader.construct_mapping(node, deep=True))
)


def _merge(base: object, over: object) -> object:
    """Compose's override-file merge, as far as these files use it (mappings merge key by key;
    ``ports`` and ``secrets`` append; other lists and scalars replace; tags reset/override)."""
    if isinstance(over, _Tagged):
        return over.value
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, _Tagged) and value.tag == "reset":
                out.pop(key, None)
            elif key in ("ports", "secrets") and key in out:
                out[key] = [*out[key], *value]
            else:
                out[key] = _merge(out.get(key), value)
        return out
    return over


MULTINODE = yaml.load((DEPLOY / "docker-compose.multinode.yml").read_text(), Loader=_ComposeLoader)
MERGED = _merge(COMPOSE, MULTINODE)


def _net_names(svc: dict) -> set[str]:
    nets = svc.get("networks") or []
    return set(nets) if isinstance(nets, (list, dict)) else set()


def test_rollout_replicas_keep_a_grace_period_past_their_drain_across_machines():
    from tests.helpers.compose import DRAIN_MARGIN_S, compose_defaults, duration_s, rollout_drain_s

    for name in ("rollout", "rollout-cpu"):
        svc = MERGED["services"][name]
        args = [compose_defaults(a) for a in svc["command"]]
        env = {k: compose_defaults(str(v)) for k, v in (svc.get("environment") or {}).items()}
        assert duration_s(svc["stop_grace_period"]) >= rollout_drain_s(args, env) + DRAIN_MARGIN_S, name


def test_trainer_on_the_host_network_and_only_redis_and_rollout_published():
    services, nets = MERGED["services"], MERGED["networks"]
    assert set(MULTINODE) == {"services", "networks", "secrets", "x-rollout-secure", "x-trainer-secure",
                              "x-secrets-group"}
    assert set(MULTINODE["services"]) == {"redis", "sandbox", "reward", "rollout", "rollout-cpu", "trainer",
                                          "trainer-cpu", "prometheus", "redis-data-owner"}
    # the one-shot that hands the Redis volume to the redis user: no network, no secrets, and Redis
    # (started as that user) waits for it
    owner = services["redis-data-owner"]
    assert owner["network_mode"] == "none" and "secrets" not in owner and "ports" not in owner
    assert owner["volumes"] == services["redis"]["volumes"]
    assert services["redis"]["user"] == "redis"
    ready = services["redis"]["depends_on"]["redis-data-owner"]["condition"]
    assert ready == "service_completed_successfully"
    for name in ("trainer", "trainer-cpu"):
        trainer = services[name]
        # host networking: compose refuses network_mode together with networks
        assert trainer["network_mode"] == "host" and "networks" not in trainer and "depends_on" not in trainer
        assert trainer["command"] == SERVICES[name]["command"] and trainer["entrypoint"] == ["torchrun"]
        assert "sandbox" not in str(trainer)
    assert services["trainer"]["deploy"] == SERVICES["trainer"]["deploy"]  # GPU reservation unchanged
    # the only published ports are on NODE_ADDR, on the one non-internal network `nodes`
    assert not nets["nodes"].get("internal")
    published = {name for name, svc in services.items() if svc.get("ports")} - {"prometheus", "grafana"}
    assert published == {"redis", "rollout", "rollout-cpu"}
    for name in published:
        assert "nodes" in _net_names(services[name]), name
        assert all(p.startswith("${NODE_ADDR:?") for p in services[name]["ports"]), name
    for name in ("rollout", "rollout-cpu"):
        assert services[name]["depends_on"] == {"sandbox": {"condition": "service_healthy"},
                                                "reward": {"condition": "service_healthy"}}
        assert _net_names(services[name]) >= {"backend", "sandbox_net"}  # still reaches its sandbox
    # the sandbox gains its token's hash and nothing else; no one else joined its network
    sandbox = services["sandbox"]
    assert {k: v for k, v in sandbox.items() if k not in ("environment", "secrets")} == SERVICES["sandbox"]
    assert sandbox["secrets"] == ["sandbox-token-sha256"]
    sandbox_nets = _net_names(sandbox)
    assert all(nets[n].get("internal") for n in sandbox_nets)
    for name, svc in services.items():
        if name not in ("sandbox", "rollout", "rollout-cpu", "prometheus"):
            assert not sandbox_nets & _net_names(svc), name


def test_every_link_is_secured_by_default():
    services = MERGED["services"]
    redis = services["redis"]["command"]
    assert redis[redis.index("--port") + 1] == "0" and redis[redis.index("--tls-port") + 1] == "6379"
    assert "--aclfile" in redis and "--appendonly" in redis
    assert "--user health" in " ".join(services["redis"]["healthcheck"]["test"])
    for name, prefix in (("sandbox", "RETOOL_SANDBOX"), ("reward", "RETOOL_REWARD"),
                         ("rollout", "RETOOL_ROLLOUT"), ("rollout-cpu", "RETOOL_ROLLOUT")):
        env = services[name]["environment"]
        assert env[f"{prefix}__SECURITY__REQUIRE_TOKEN"] == "true", name
    for name in ("rollout", "rollout-cpu"):
        env = services[name]["environment"]
        assert env["RETOOL_ROLLOUT__WEIGHT_TLS__CLIENT_CA_FILE"]  # mutual TLS on the push
        assert env["RETOOL_ROLLOUT__SECURITY__TLS__CERT_FILE"]  # HTTPS
        assert env["RETOOL_ROLLOUT__REDIS__AUTH__USERNAME"] == "rollout"
        assert env["RETOOL_WEIGHT_TOKEN"] == ""  # the token comes from the secret file only
        assert "https://localhost:8000/healthz" in services[name]["healthcheck"]["test"]
    for name in ("trainer", "trainer-cpu"):
        env = services[name]["environment"]
        assert env["RETOOL_TRAINER__REDIS_AUTH__USERNAME"] == "trainer"
        assert env["RETOOL_TRAINER__WEIGHT_TLS__CERT_FILE"] and env["RETOOL_TRAINER__WEIGHT_TLS__SERVER_NAME"]
        assert env["RETOOL_WEIGHT_TOKEN"] == ""


def test_every_secret_named_is_mounted_and_written_by_secrets_init(tmp_path):
    services, declared = MERGED["services"], MULTINODE["secrets"]
    for name, svc in services.items():
        mounted = set(svc.get("secrets") or [])
        assert mounted <= set(declared), name
        named = {v.removeprefix("/run/secrets/") for v in (svc.get("environment") or {}).values()
                 if isinstance(v, str) and v.startswith("/run/secrets/")}
        named |= set(re.findall(r"/run/secrets/([a-z0-9.-]+)", " ".join(map(str, svc.get("command") or []))))
        named |= set(re.findall(r"/run/secrets/([a-z0-9.-]+)", str(svc.get("healthcheck", ""))))
        assert named <= mounted, (name, named - mounted)
    written = set(init_secrets(tmp_path / "secrets"))
    for name, spec in declared.items():
        assert spec["file"].startswith("${RETOOL_SECRETS_DIR:-./secrets}/"), name
        assert spec["file"].rsplit("/", 1)[1] in written, name
    assert "ca.key" not in {spec["file"].rsplit("/", 1)[1] for spec in declared.values()}  # stays offline
    prom = services["prometheus"]
    assert "./prometheus/prometheus.secure.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]


def test_every_service_mounting_a_group_readable_secret_runs_in_its_group(tmp_path):
    """Compose bind-mounts a secret file with its host owner and mode: the 0640 ones (keys, tokens,
    passwords) are readable in a container only through RETOOL_SECRETS_GID (issue 33, 5d)."""
    import stat

    out = tmp_path / "secrets"
    init_secrets(out)
    services, declared = MERGED["services"], MULTINODE["secrets"]
    mode = {name: stat.S_IMODE((out / spec["file"].rsplit("/", 1)[1]).stat().st_mode)
            for name, spec in declared.items()}
    assert not any(m & 0o004 for name, m in mode.items() if m != 0o644), mode
    for name, svc in services.items():
        private = [s for s in svc.get("secrets") or [] if mode[s] != 0o644]
        if private:
            assert mode.keys() >= set(private) and all(mode[s] == 0o640 for s in private), (name, private)
            assert [g.split(":", 1)[0] for g in svc.get("group_add", [])] == ["${RETOOL_SECRETS_GID"], name
    # the redis image drops to its user with su-exec, which would drop the group: it starts as redis
    assert services["redis"]["user"] == "redis"
    assert not [s for s in services["sandbox"]["secrets"] if mode[s] != 0o644]  # only its digest


def test_secure_prometheus_config_differs_only_in_the_rollout_jobs_https():
    plain = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    secure = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.secure.yml").read_text())
    rollout = next(j for j in secure["scrape_configs"] if j["job_name"] == "rollout")
    assert rollout.pop("scheme") == "https"
    assert rollout.pop("tls_config") == {"ca_file": "/run/secrets/ca", "server_name": "rollout"}
    assert secure == plain


def test_multinode_run_config_lists_remote_replicas_inside_the_published_port_ranges():
    cfg = load_config(RunConfig, file=DEPLOY / "trainer" / "multinode.yaml")
    assert cfg.trainer.fsdp.backend == "nccl" and cfg.metrics_port == 9100 and cfg.metrics_host == "0.0.0.0"
    ranges = {}
    for spec in MERGED["services"]["rollout"]["ports"]:
        low, high, container = re.fullmatch(r"\$\{[^}]*\}:(\d+)-(\d+):(\d+)", spec).groups()
        ranges[int(container)] = range(int(low), int(high) + 1)
    assert cfg.rollout_targets and all(":" in t and not t.startswith("dns:") for t in cfg.rollout_targets)
    for target in cfg.rollout_targets:
        assert int(target.rsplit(":", 1)[1]) in ranges[50051], target
    for url in cfg.rollout_urls:
        assert url.startswith("https://") and int(url.rsplit(":", 1)[1]) in ranges[8000], url
    assert cfg.redis_url.endswith(":6379/0") and "redis://redis" not in cfg.redis_url
    assert MERGED["services"]["redis"]["ports"][0].endswith(":6379:6379")
