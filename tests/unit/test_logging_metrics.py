import json
import logging

from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.common.logging import JsonFormatter
from services.common.metrics import MetricsRegistry, add_observability_routes


def test_json_log_line_redacts_secrets():
    rec = logging.makeLogRecord({"msg": "push %s", "args": ("ok",), "levelname": "INFO", "name": "t",
                                 "weight_token": "abc", "version": 3})
    line = json.loads(JsonFormatter().format(rec))
    assert line["msg"] == "push ok" and line["version"] == 3
    assert line["weight_token"] == "***"


def test_two_apps_have_independent_registries_and_health():
    state = {"status": "ok"}
    apps = []
    for _ in range(2):
        m = MetricsRegistry("svc")
        c = m.counter("hits_total", "hits")
        app = FastAPI()
        add_observability_routes(app, m, lambda: state)
        apps.append((app, c))
    apps[0][1].inc(3)
    with TestClient(apps[0][0]) as a, TestClient(apps[1][0]) as b:
        assert "svc_hits_total 3.0" in a.get("/metrics").text
        assert "svc_hits_total 0.0" in b.get("/metrics").text
        assert a.get("/healthz").status_code == 200
        state["status"] = "degraded"
        assert a.get("/healthz").status_code == 503
