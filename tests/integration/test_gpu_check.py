"""The GPU check's CPU mode (``python -m bench.gpu --device cpu``): every section runs the code the
GPU run uses, on small sizes, and the report keeps its documented format (docs/gpu-check.md).

Timing is not asserted (that is the report's job); what is: each section finished ``ok``, the
report validates, and the numbers are sane (the FSDP steps equal the CPU reference step, every
attention backend that ran computes the loop's output, delta encoders agree, rates are positive).
A second run proves the robustness: a failing section and a section killed at its budget are
recorded and the check goes on.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.report import SECTIONS, Report

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _check(out: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, Report, str]:
    cmd = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, **(env or {})})
    report = Report.model_validate_json((out / "gpu-report.json").read_text())
    return proc.returncode, report, proc.stdout + proc.stderr


@pytest.mark.timeout(1500)
@pytest.mark.slow(reason="every section of the GPU check in CPU mode, under its 1200 s deadline",
                  budget_s=1400)
def test_cpu_mode_runs_every_section_and_reports_sane_numbers(tmp_path: Path) -> None:
    rc, report, log = _check(tmp_path, "--deadline-s", "1200")
    assert [s.name for s in report.sections] == list(SECTIONS)
    assert {s.name: s.status for s in report.sections} == dict.fromkeys(SECTIONS, "ok"), log
    assert rc == 0 and report.device == "cpu" and report.total_seconds <= report.deadline_s

    env = report.section("env").results
    import torch

    assert env["torch"] == torch.__version__ and env["gpu_name"] is None and env["bf16_peak_tflops"] is None

    tr = report.section("trainer").results
    assert tr["backend"] == "gloo" and tr["world_size"] == 1
    ref = tr["reference"]
    assert ref["passed"] and ref["cpu_fsdp_fp32"]["pg_loss_abs_diff"] < 1e-5, ref  # same math, fp32
    assert ref["cpu_fsdp_bf16"]["passed"]
    (run,) = tr["runs"]
    assert run["tokens_per_s"] > 0 and run["mfu"] is None and math.isfinite(run["pg_loss"])
    assert run["timed_steps"] >= 1 and run["parameters"] > 0

    pk = report.section("packing").results
    assert pk["padded_computed_tokens"] >= pk["real_tokens"] > 0
    assert pk["default_backend"] == "loop"
    assert set(pk["model"]) == {"packed (loop)", "padded (sdpa, 2-D mask)"}
    arms = pk["attention"]["arms"]
    assert "seconds" in arms["loop"] and "seconds" in arms["sdpa + block mask"]
    assert all(a["max_abs_diff_vs_loop"] < 1e-4 for a in arms.values() if "seconds" in a), arms
    assert "not available" in arms["torch_varlen"]["error"]  # CUDA only: recorded, not fatal

    en = report.section("engine").results
    assert [r["concurrency"] for r in en["rows"]] == [1, 32, 128] and all(r["tok_s"] > 0 for r in en["rows"])

    wt = report.section("weights").results
    assert wt["encode_payloads_identical"] and 0 < wt["density"] < 0.5
    assert wt["push"]["delta_wire_bytes"] < wt["full_bf16_bytes"] / 2
    assert wt["delta_vs_disk"] > 0 and wt["faster_encoder"] in ("host", "device")

    md = (tmp_path / "gpu-report.md").read_text()
    assert "| section | status |" in md and all(f"| {s} | ok |" in md for s in SECTIONS)
    assert json.loads((tmp_path / "gpu-report.json").read_text())["schema_version"] == 1


def test_a_failing_section_and_a_hung_one_are_recorded_and_the_check_goes_on(tmp_path: Path) -> None:
    # env fails (fault injected), packing is killed at a 2 s budget (its imports alone take longer),
    # engine still runs; the others were not selected
    rc, report, log = _check(tmp_path, "--sections", "env,packing,engine", "--budget", "packing=2",
                             env={"RETOOL_GPU_CHECK_FAULT": "env"})
    status = {s.name: s.status for s in report.sections}
    assert status == {"env": "error", "trainer": "skipped", "packing": "timeout", "engine": "ok",
                      "weights": "skipped"}, log
    assert rc == 1
    assert "fault injected" in (report.section("env").error or "")
    assert "budget of 2 s" in (report.section("packing").error or "")
    assert report.section("engine").results["rows"]
    assert "| env | error |" in (tmp_path / "gpu-report.md").read_text()
