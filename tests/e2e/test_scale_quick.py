"""``bench/scale.py --quick`` in CI: the real services (Redis, sandbox, reward, a rollout replica on the
synthetic engine, the trainer in ``step_mode=null``) for two steps. It fails when a component errors
or the ledger check fails; no timing is asserted (the figures belong to the benchmark's output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200),
              pytest.mark.slow(reason="starts Redis, a 128-worker sandbox, reward, a rollout replica and the "
                               "trainer, and runs two steps (265 s at load 8-10)", budget_s=900)]
ROOT = Path(__file__).resolve().parents[2]


def test_scale_quick_runs_clean_and_nothing_is_lost(tmp_path):
    out = tmp_path / "scale"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=1150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "scale.json").read_text())
    assert report["failed"] is None and report["steps"] == 2
    assert report["step_mode"] == "null" and "step_mode | null" in proc.stdout
    assert report["ledger"]["ok"] and report["ledger"]["trained_groups"] == 2
    assert report["wire_groups"] >= 2 and report["generated_tokens"] > 0
    assert report["sandbox_calls"] > 0  # the scripted code blocks reached the real sandbox
    assert (out / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the figure of where time goes
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m.get("step_mode=null") == 1.0 for m in metrics if "perf/step_seconds" in m)
