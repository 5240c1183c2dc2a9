"""``retool demo --quick`` end to end, as a user runs it: real CLI process, real services
(private Redis, sandbox, reward, rollout, trainer as separate processes), fixed seed. It runs on a
PATH without ``redis-server``, as on a fresh machine: the queue is the embedded Valkey server (the
integration tests cover redis-server).

Asserts that the whole pipeline ran (every artifact written, one metrics record per GRPO step,
a plot, a log per service) and that RL improved held-out accuracy by at least 0.10 and raised
the tool-use rate. Budget: well under 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.demo.pipeline import QUICK
from tests.helpers.demo_run import run_demo
from tests.helpers.hide_binary import path_without

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(660),
              pytest.mark.slow(reason="the quick demo: SFT then GRPO on CPU, bounded at 600 s", budget_s=640)]


def test_quick_demo_learns_to_use_the_tool(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    shm_before = {str(p) for p in Path("/dev/shm").glob("retool-weights-*")}
    env = {**os.environ, "PATH": path_without("redis-server", tmp_path / "bin")}
    stdout, stderr = run_demo("--quick", "--out", str(out), timeout_s=600, env=env)
    # the log says which Redis it started and why
    assert "queue = private embedded (Valkey 9.1." in stderr and "no redis-server on PATH" in stderr, stderr

    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == QUICK["grpo"]["steps"]
    before, after = report["before"], report["after"]
    for phase in (before, after):
        assert set(phase) == {"accuracy", "tool_use_rate", "mean_turns"}
    assert after["accuracy"] >= before["accuracy"] + 0.10, report
    assert after["tool_use_rate"] > before["tool_use_rate"], report
    assert json.loads(stdout)["after"] == after  # the console summary is the report

    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r["phase"] == "grpo"]
    assert [r["step"] for r in grpo] == list(range(1, report["steps"] + 1))
    assert all(0 <= r["tool_use_rate"] <= 1 and 0 <= r["accuracy"] <= 1 for r in grpo)
    assert [r["when"] for r in records if r["phase"] == "eval"] == ["before", "after"]
    assert sum(r["phase"] == "sft" for r in records) == QUICK["sft"]["steps"]

    assert (out / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("sandbox", "reward", "rollout", "trainer"):
        assert (out / "logs" / f"{name}.log").stat().st_size > 0, name
    # the trainer really pushed every step's weights to the rollout replica
    assert "weights/push_seconds" in json.loads((out / "grpo" / "metrics.jsonl").read_text().splitlines()[-1])
    # ... through the replica's shared-memory segments, which are gone once the demo has stopped
    rollout_log = (out / "logs" / "rollout.log").read_text()
    assert rollout_log.count("weights committed from shared memory") == report["steps"]
    # none of its own left: the segments its replica logged creating (other processes' may come and go)
    created = [p for line in rollout_log.splitlines() if "shared-memory weight segments created" in line
               for p in json.loads(line)["paths"]]
    assert len(created) == 2 and not set(created) & shm_before, created
    assert [p for p in created if os.path.exists(p)] == [], created
