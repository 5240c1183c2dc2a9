"""Deployment files, validated without a Docker engine (none runs here).

- the compose file is parsed and its security/health structure checked;
- Prometheus config and alert rules pass ``promtool``;
- a real Prometheus scrapes real sandbox and reward services, and every metric named by a
  dashboard panel or an alert rule is present in what it scraped;
- the dashboards are exactly what their generator writes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.common.process import ServiceProcess, free_port
from services.sandbox.launcher import SandboxProcess

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
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(
            f"{name} not found: install the Debian package 'prometheus' (make test does it as root)"
        )
    return path


def test_every_service_has_a_healthcheck_and_restart_policy():
    assert {"redis", "sandbox", "reward", "rollout", "prometheus", "grafana"} <= set(SERVICES)
    for name, svc in SERVICES.items():
        assert "healthcheck" in svc, name
        assert svc.get("restart") == "unless-stopped" or "<<" in str(svc), name


def test_depends_on_waits_for_health():
    for name, svc in SERVICES.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, (name, dep)


def test_sandbox_has_no_route_to_redis_or_the_internet():
    nets = COMPOSE["networks"]
    sandbox_nets = set(SERVICES["sandbox"]["networks"])
    assert all(nets[n].get("internal") for n in sandbox_nets), "sandbox network must be internal"
    for other in ("redis", "reward"):
        assert not sandbox_nets & set(SERVICES[other]["networks"]), other
    assert "trainer" not in SERVICES or not sandbox_nets & set(SERVICES["trainer"]["networks"])


def test_sandbox_container_is_hardened():
    sb = SERVICES["sandbox"]
    assert sb["read_only"] is True and sb["cap_drop"] == ["ALL"]
    assert set(sb["cap_add"]) <= {"SYS_ADMIN", "SETUID", "SETGID", "CHOWN", "KILL"}
    assert "no-new-privileges:true" in sb["security_opt"]
    assert sb["pids_limit"] > 0 and sb["mem_limit"]
    text = (DEPLOY / "docker-compose.yml").read_text()
    for cap in sb["cap_add"]:  # every capability is justified in a comment
        assert re.search(rf"- {cap}\s+# \w", text), cap


def test_redis_is_durable_and_secrets_come_from_env():
    assert (
        "--appendonly" in SERVICES["redis"]["command"] and "redis-data:/data" in SERVICES["redis"]["volumes"]
    )
    env_example = (DEPLOY / ".env.example").read_text()
    for var in ("RETOOL_WEIGHT_TOKEN", "MODEL_DIR", "ROLLOUT_GPUS", "SANDBOX_REPLICAS", "ROLLOUT_REPLICAS"):
        assert f"{var}=" in env_example
    assert "RETOOL_WEIGHT_TOKEN" not in str(SERVICES["sandbox"])


def _prometheus_dir(tmp_path: Path, targets: dict[str, str] | None = None) -> Path:
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["rule_files"] = [str(tmp_path / "alerts.yml")]
    if targets is not None:
        cfg["global"]["scrape_interval"] = "1s"
        cfg["scrape_configs"] = [
            {"job_name": job, "static_configs": [{"targets": [addr]}]} for job, addr in targets.items()
        ]
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    return tmp_path


def test_promtool_accepts_config_and_rules(tmp_path):
    d = _prometheus_dir(tmp_path)
    for args in (["check", "config", str(d / "prometheus.yml")], ["check", "rules", str(d / "alerts.yml")]):
        out = subprocess.run([_tool("promtool"), *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


def test_dashboards_are_generated_and_valid_json():
    sys.path.insert(0, str(DEPLOY / "grafana"))
    import make_dashboards

    rendered = make_dashboards.render()
    files = {p.name: p.read_text() for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    assert files == rendered, "run: python deploy/grafana/make_dashboards.py"


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b([a-z_][a-z0-9_]*)\b(?=\s*[\[{)]|\s*$|\s*[<>]|\s+and|\s*/)", expr))
    return {n.removesuffix("_bucket") for n in names if n not in _PROMQL_WORDS and "_" in n}


def _queried_metrics() -> set[str]:
    import json

    names: set[str] = set()
    for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                names |= _metric_names(target["expr"])
    for group in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            names |= _metric_names(rule["expr"])
    return names


def test_real_prometheus_scrapes_every_metric_the_dashboards_and_alerts_use(tmp_path):
    queried = _queried_metrics()
    assert {"sandbox_requests_total", "sandbox_execution_seconds", "reward_grades_total"} <= queried
    with (
        SandboxProcess(
            ["--set", "max_concurrency=4", "--set", "zygotes=1", "--set", "light_zygotes=0"]
        ) as sb,
        ServiceProcess(["reward", "serve", "--set", "workers=1"]) as rw,
    ):
        httpx.post(f"{sb.url}/run_code", json={"code": "print(1)", "language": "python"}, timeout=60)
        httpx.post(f"{rw.url}/score", json={"response": "Answer: 1", "ground_truth": "1"}, timeout=60)
        port = free_port()
        d = _prometheus_dir(tmp_path, {"sandbox": f"127.0.0.1:{sb.port}", "reward": f"127.0.0.1:{rw.port}"})
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
        try:
            api = f"http://127.0.0.1:{port}/api/v1"
            deadline = time.monotonic() + 60
            names: set[str] = set()
            while time.monotonic() < deadline:
                try:
                    up = httpx.get(f"{api}/query", params={"query": "up"}, timeout=5).json()["data"]["result"]
                    if len(up) == 2 and all(r["value"][1] == "1" for r in up):
                        names = set(httpx.get(f"{api}/label/__name__/values", timeout=5).json()["data"])
                        if queried <= {n.removesuffix("_bucket") for n in names}:
                            break
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                time.sleep(0.5)
            missing = queried - {n.removesuffix("_bucket") for n in names}
            assert not missing, f"dashboards/alerts use metrics no service exports: {sorted(missing)}"
            rules = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
            assert {g["name"] for g in rules} == {"sandbox", "reward"}
        finally:
            prom.terminate()
            prom.wait(10)
