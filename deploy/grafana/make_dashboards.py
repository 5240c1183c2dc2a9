"""Generates the provisioned Grafana dashboards (deploy/grafana/dashboards/*.json).

Run after changing a panel: ``python deploy/grafana/make_dashboards.py``. The test suite
checks the JSON files are what this script writes, and that every metric a panel queries
is exported by a running service.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("dashboards")
DS = {"type": "prometheus", "uid": "prometheus"}


def panel(pid: int, title: str, exprs: dict[str, str], unit: str = "short", x: int = 0, y: int = 0) -> dict:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(65 + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(exprs.items())
        ],
    }


def dashboard(uid: str, title: str, panels: list[dict]) -> dict:
    for i, p in enumerate(panels):
        p["gridPos"]["x"], p["gridPos"]["y"] = (i % 2) * 12, (i // 2) * 8
    return {
        "uid": uid,
        "title": title,
        "tags": ["retool"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "panels": panels,
    }


def q(metric: str, quantile: float) -> str:
    return f"histogram_quantile({quantile}, sum by (le) (rate({metric}_bucket[5m])))"


DASHBOARDS = {
    "sandbox": dashboard(
        "retool-sandbox",
        "ReTool / Sandbox",
        [
            panel(
                1,
                "Requests by status",
                {"{{status}}": "sum by (status) (rate(sandbox_requests_total[1m]))"},
                "reqps",
            ),
            panel(
                2,
                "Latency p50 / p99",
                {"p50": q("sandbox_execution_seconds", 0.5), "p99": q("sandbox_execution_seconds", 0.99)},
                "s",
            ),
            panel(3, "Executions in flight", {"in flight": "sum(sandbox_executions_in_flight)"}),
            panel(4, "Queue depth", {"queued": "sum(sandbox_queue_depth)"}),
            panel(
                5,
                "Rejections",
                {"{{reason}}": "sum by (reason) (rate(sandbox_rejections_total[5m]))"},
                "reqps",
            ),
            panel(
                6,
                "Output truncations",
                {"truncated": "sum(rate(sandbox_output_truncations_total[5m]))"},
                "reqps",
            ),
        ],
    ),
    "reward": dashboard(
        "retool-reward",
        "ReTool / Reward",
        [
            panel(1, "Grades per second", {"grades/s": "sum(rate(reward_grades_total[1m]))"}, "reqps"),
            panel(
                2, "Outcome mix", {"{{reason}}": "sum by (reason) (rate(reward_grades_total[5m]))"}, "reqps"
            ),
            panel(3, "Timeouts", {"timeouts/s": "sum(rate(reward_timeouts_total[5m]))"}, "reqps"),
            panel(
                4,
                "Grade latency p50 / p99",
                {"p50": q("reward_grade_seconds", 0.5), "p99": q("reward_grade_seconds", 0.99)},
                "s",
            ),
        ],
    ),
}


def render() -> dict[str, str]:
    return {f"{name}.json": json.dumps(d, indent=2, sort_keys=True) + "\n" for name, d in DASHBOARDS.items()}


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
