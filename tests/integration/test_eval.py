"""retool eval on a tiny model: the CLI starting its own sandbox/reward/rollout processes, and the
library against a running rollout service (same seed -> same responses). All real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.process import ServiceProcess
from services.demo.task import write_parquet
from tests.helpers import agent_fixtures

reward_url = agent_fixtures.reward_url  # a real reward service (session fixture)

ROWS = [
    {"data_source": "org/arith", "prompt": [{"role": "user", "content": f"What is {a}*{b}? Use code."}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
     "extra_info": {"index": f"q{i}"}}
    for i, (a, b) in enumerate([(12, 34), (7, 8), (123, 4)])
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.tiny_model import tiny_model_dir

    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_parquet(tmp_path_factory.mktemp("eval-data") / "val.parquet", ROWS)


def _samples(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]


def test_cli_starts_its_services_and_reports(tiny_model, data, tmp_path) -> None:
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "services.cli", "eval", "--model", str(tiny_model), "--data", str(data),
           "--n", "4", "--out", str(out), "--set", "max_tokens=24", "--set", "max_turns=1",
           "--set", "n_bootstrap=50", "--set", "concurrency=3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    samples = _samples(out)
    assert len(samples) == 12 and report["summary"]["responses"] == 12 and report["summary"]["prompts"] == 3
    assert {s["job_id"] for s in samples} == {"q0", "q1", "q2"}
    assert all(s["reward"] is not None for s in samples)  # every response scored by the reward service
    # the report agrees with its own samples
    acc = sum(bool(s["correct"]) for s in samples) / 12
    assert report["summary"]["accuracy"] == pytest.approx(acc)
    per_problem = [sum(bool(s["correct"]) for s in samples if s["job_id"] == q) / 4
                   for q in ("q0", "q1", "q2")]
    assert report["metrics"]["val-core/org/arith/acc/mean@4"] == pytest.approx(sum(per_problem) / 3)
    assert 0.0 <= report["metrics"]["val-core/org/arith/acc/maj@4/mean"] <= 1.0  # unanswered = "[INVALID]"
    turns = [s["turns"] for s in samples]
    assert report["metrics"]["val-aux/num_turns/max"] == max(turns)
    calls = sum(s["tool_calls"] for s in samples)
    assert report["summary"]["tool_calls_per_response"] == pytest.approx(calls / 12)
    assert max(s["response_tokens"] for s in samples) <= 24
    assert "| org/arith (N=4) |" in (out / "report.md").read_text()
    for png in ("accuracy_at_k.png", "distributions.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for log in ("sandbox.log", "reward.log", "rollout.log"):
        assert (out / "logs" / log).exists()
    metrics_line = json.loads(proc.stdout)
    assert "val-core/org/arith/acc/mean@4" in metrics_line["metrics"]


def test_cli_refuses_impossible_settings_before_starting(data, tmp_path) -> None:
    cmd = [sys.executable, "-m", "services.cli", "eval", "--data", str(data), "--out", str(tmp_path / "x")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "either 'model'" in proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def rollout_url(tiny_model, sandbox_url, reward_url, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("eval-rollout") / "rollout.log"
    args = ["rollout", "serve", "--model", str(tiny_model), "--sandbox-url", sandbox_url,
            "--reward-url", reward_url]
    with ServiceProcess(args, log_path=log, startup_timeout_s=120) as proc:
        yield proc.url


def test_same_seed_same_responses_against_a_running_service(rollout_url, data, tmp_path) -> None:
    from services.eval.run import EvalConfig, evaluate

    def run(seed: int, name: str) -> list[str]:
        cfg = EvalConfig(data=str(data), rollout_urls=[rollout_url], n=3, seed=seed, max_tokens=20,
                         max_turns=1, temperature=1.0, top_p=1.0, n_bootstrap=20,
                         out_dir=str(tmp_path / name))
        report = evaluate(cfg)
        assert report.summary.responses == 9
        return [s["response_text"] for s in _samples(tmp_path / name)]

    first, again, other = run(5, "a"), run(5, "b"), run(6, "c")
    assert first == again
    assert first != other
