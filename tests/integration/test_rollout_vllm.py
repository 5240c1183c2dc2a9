"""``retool rollout serve --set engine=vllm`` (vLLM's CPU build, float32) as a real process, with the real
sandbox and reward services, taking ``retool rollout push-weights`` over gRPC.

The model is a real Qwen2 model whose greedy continuation writes ``<code>print(6*7)</code>`` after the
prompt and after every interpreter result (tests/helpers/scripted_model.py), so a rollout really calls
the sandbox several times; a second one writes ``print(8*9)``. The last test kills vLLM's engine core
and checks that ``/healthz`` turns 503 with the reason (it runs last: the replica is dead after it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.common.process import ServiceProcess, free_port
from tests.helpers import agent_fixtures
from tests.helpers.engines import VLLM_TEST_KWARGS
from tests.helpers.scripted_model import scripted_model_dir

pytestmark = pytest.mark.integration
reward_url = agent_fixtures.reward_url
TOKEN = "vllm-push-token-6c1d"
REQUEST = {
    "messages": [{"role": "user", "content": "Compute 6*7 with code."}],
    "ground_truth": "42",
    "n": 1,
    "max_turns": 2,
    "sampling": {"temperature": 0, "max_tokens": 64},
}


def engine_flags() -> list[str]:
    flags = ["--set", "engine=vllm"]
    for key, value in VLLM_TEST_KWARGS.items():
        flags += ["--set", f"engine_kwargs.{key}={str(value).lower() if isinstance(value, bool) else value}"]
    return flags


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scripted")
    a = scripted_model_dir(root / "a", "print(6*7)")
    b = scripted_model_dir(root / "b", "print(8*9)")
    norm = "model.norm.weight"
    bad_shape = _altered(a, root / "bad-shape", lambda n, t: t[..., :-1] if n == norm else t)
    bad_dtype = _altered(a, root / "bad-dtype", lambda n, t: t.to(torch.int32) if n == norm else t)
    return {"a": a, "b": b, "bad_shape": bad_shape, "bad_dtype": bad_dtype}


def _altered(src: Path, out: Path, change: Any) -> Path:
    from safetensors.torch import load_file, save_file

    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    save_file({n: change(n, t).contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def replica(models, sandbox_url, reward_url, tmp_path_factory) -> Iterator[tuple[ServiceProcess, int, Path]]:
    log = tmp_path_factory.mktemp("rollout-vllm") / "rollout.log"
    grpc_port = free_port()
    args = ["rollout", "serve", "--model", str(models["a"]), "--sandbox-url", sandbox_url,
            "--reward-url", reward_url, "--grpc-port", str(grpc_port), "--weight-token-env", "PUSH_TOKEN",
            *engine_flags()]
    with ServiceProcess(args, env={"PUSH_TOKEN": TOKEN}, log_path=log, startup_timeout_s=300) as proc:
        yield proc, grpc_port, log
    assert TOKEN not in log.read_text()


def push(checkpoint: Path, grpc_port: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RETOOL_WEIGHT_TOKEN": TOKEN}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "rollout", "push-weights", "--checkpoint", str(checkpoint),
         "--target", f"127.0.0.1:{grpc_port}", *extra],
        env=env, capture_output=True, text=True, timeout=300)


def rollout(url: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/rollouts", json=REQUEST, timeout=300)
    assert r.status_code == 200, r.text
    [traj] = r.json()["trajectories"]
    return traj


def _tool_outputs(traj: dict[str, Any]) -> list[str]:
    text = traj["response_text"]
    return [part.split("</interpreter>")[0].strip() for part in text.split("<interpreter>")[1:]]


def test_multi_turn_tool_rollout_and_exact_weight_pushes(replica, models) -> None:
    proc, grpc_port, _ = replica
    health = httpx.get(proc.url + "/healthz").json()
    assert health["status"] == "ok" and health["engine"] == "vllm" and health["engine_error"] is None

    first = rollout(proc.url)
    assert first["tool_calls"] == 2 and first["finish_reason"] == "max_turns"
    assert _tool_outputs(first) == ["42", "42"]  # the sandbox really ran print(6*7), twice
    # a third call is written, then max_turns ends the response without running it
    assert first["response_text"].count("<code>print(6*7)</code>") == 3 and first["turns"] == 3
    gen = [v for v, m in zip(first["versions"], first["loss_mask"], strict=True) if m]
    assert set(gen) == {0} and 0 in first["loss_mask"]  # interpreter tokens are not the policy's
    assert first["reward"] == -1.0 and first["reward_reason"] == "no_answer"  # graded by the reward service

    res = push(models["b"], grpc_port, "--version", "5")
    assert res.returncode == 0, res.stdout + res.stderr
    assert httpx.get(proc.url + "/healthz").json()["weight_version"] == 5
    other = rollout(proc.url)
    assert _tool_outputs(other) == ["72", "72"] and "print(8*9)" in other["response_text"]
    assert {v for v, m in zip(other["versions"], other["loss_mask"], strict=True) if m} == {5}

    res = push(models["a"], grpc_port)  # no --version: one above the served one
    assert res.returncode == 0, res.stdout + res.stderr
    back = rollout(proc.url)
    assert back["response_ids"] == first["response_ids"]  # the original weights, exactly
    assert back["logprobs"] == pytest.approx(first["logprobs"], abs=1e-4)
    assert {v for v, m in zip(back["versions"], back["loss_mask"], strict=True) if m} == {6}


@pytest.mark.parametrize(("which", "message"), [
    ("bad_shape", "shape [255]"),
    ("bad_dtype", "dtype int32"),
])
def test_malformed_push_is_refused_and_changes_nothing(replica, models, which, message) -> None:
    proc, grpc_port, _ = replica
    version = httpx.get(proc.url + "/healthz").json()["weight_version"]
    before = rollout(proc.url)
    res = push(models[which], grpc_port, "--version", "99")
    assert res.returncode == 1 and "INVALID_ARGUMENT" in res.stdout and message in res.stdout, res.stdout
    health = httpx.get(proc.url + "/healthz").json()
    assert health["weight_version"] == version and health["status"] == "ok"
    after = rollout(proc.url)
    assert after["response_ids"] == before["response_ids"]


def test_unknown_engine_setting_is_a_config_error_before_start(models, sandbox_url) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "rollout", "serve", "--model", str(models["a"]),
         "--port", str(free_port()), "--sandbox-url", sandbox_url, "--set", "engine=vllm",
         "--set", "engine_kwargs.tensor_paralel_size=4"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "engine_kwargs" in res.stderr and "tensor_paralel_size" in res.stderr


def test_zz_dead_engine_makes_healthz_fail_with_the_reason(replica) -> None:
    """Runs last in this module (the replica stays dead)."""
    proc, _, _ = replica
    assert proc.proc is not None
    cores = [pid for pid in _descendants(proc.proc.pid) if "EngineCore" in _cmdline_or_comm(pid)]
    assert cores, "no vLLM engine-core process found under the rollout server"
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = httpx.get(proc.url + "/healthz", timeout=10)
        if r.status_code == 503:
            break
        time.sleep(0.5)
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["status"] == "error" and "dead" in body["engine_error"]
    refused = httpx.post(proc.url + "/v1/rollouts", json=REQUEST, timeout=60)
    assert refused.status_code == 503 and "dead" in refused.json()["detail"]


def _descendants(pid: int) -> list[int]:
    out = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            out += [int(child), *_descendants(int(child))]
    return out


def _cmdline_or_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text() + Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""
