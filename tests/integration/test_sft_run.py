"""`retool sft run` end to end on the tiny model: 2-process gloo FSDP under torchrun, checkpoint +
resume, Hugging Face export; and a plain one-process run whose exported weights equal its
in-memory weights and match the 2-process run (the loss is a global-batch token mean)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from services.data.retool_sft import prepare_retool_sft
from tests.helpers.datasets import retool_sft_row, write_retool_sft
from tests.helpers.tiny_model import tiny_model_dir
from tests.helpers.torchrun import torchrun_cmd, torchrun_env

TRACE = ("Let me compute {a} + {b}.\n<code>\n```python\nprint({a} + {b})\n```\n</code>\n<interpreter>\n{c}\n"
         "</interpreter>\nThe sum is {c}.\n<answer>\\boxed{{{c}}}</answer>")


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft")
    rows = [retool_sft_row(f"What is {a} + {b}?", TRACE.format(a=a, b=b, c=a + b)) for a, b in
            [(1, 2), (3, 4), (10, 7), (6, 6), (12, 30), (5, 9), (8, 1), (2, 22)]]
    write_retool_sft(root / "raw.parquet", rows)
    report = prepare_retool_sft(root / "raw.parquet", root / "sft.parquet")
    assert report.rows_written == 8
    return {"root": root, "model": tiny_model_dir(tmp_path_factory), "data": root / "sft.parquet"}


def _config(inputs: dict[str, Path], out: Path) -> dict[str, Any]:
    return {
        "model_path": str(inputs["model"]),
        "data": {"train_files": [str(inputs["data"])], "max_length": 512},
        "epochs": 3, "batch_size": 4, "micro_batch_size": 1,  # 8 samples: 2 steps per epoch, 6 steps
        "optim": {"lr": 3e-3, "warmup_ratio": 0.2},
        "fsdp": {"param_dtype": "fp32", "gradient_checkpointing": False, "backend": "gloo"},
        "checkpoint": {"dir": str(out / "ckpt"), "save_freq": 3, "keep_last": 2},
        "output_dir": str(out / "hf"), "metrics_path": str(out / "metrics.jsonl"), "progress": False,
    }


def _torchrun(config: Path, log: Path) -> int:
    cmd = torchrun_cmd("sft", "run", "--config", str(config))
    with log.open("ab") as fh:
        return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=torchrun_env(),
                              timeout=240).returncode


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def torchrun_run(sft_inputs: dict[str, Path]) -> dict[str, Any]:
    out = sft_inputs["root"] / "ddp"
    out.mkdir()
    config = out / "sft.yaml"
    config.write_text(yaml.safe_dump(_config(sft_inputs, out)))
    log = out / "run.log"
    assert _torchrun(config, log) == 0, log.read_text()[-4000:]
    return {"out": out, "config": config, "log": log, "weights": _weights(out / "hf"),
            "records": _records(out / "metrics.jsonl")}


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_two_process_sft_learns_checkpoints_resumes_and_exports(torchrun_run: dict[str, Any]) -> None:
    out, records = torchrun_run["out"], torchrun_run["records"]
    start, *steps, exported = records
    assert start["event"] == "start" and start["world_size"] == 2 and start["total_steps"] == 6
    assert start["data"]["used"] == 8 and start["data"]["dropped_too_long"] == 0
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[-1]["epoch"] == pytest.approx(3.0)
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["lr"] > 0 for r in steps)
    assert steps[-1]["loss"] < 0.7 * steps[0]["loss"]  # the repeated tiny data set is being learnt
    assert exported["event"] == "exported"
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_00000003", "step_00000006"]

    # a crash after step 5: the last checkpoint is step 3 (mid-epoch); the rerun resumes there, same result
    shutil.rmtree(out / "ckpt" / "step_00000006")
    shutil.rmtree(out / "hf")
    log = torchrun_run["log"]
    assert _torchrun(torchrun_run["config"], log) == 0, log.read_text()[-4000:]
    again = _records(out / "metrics.jsonl")[len(records):]
    assert again[0]["event"] == "start" and again[0]["step"] == 3
    assert [r["step"] for r in again[1:-1]] == [4, 5, 6]
    for before, after in zip(steps[3:], again[1:-1], strict=True):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)
        assert after["lr"] == pytest.approx(before["lr"], rel=1e-9)
    for name, value in _weights(out / "hf").items():
        torch.testing.assert_close(value, torchrun_run["weights"][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_single_process_export_holds_the_trained_weights(sft_inputs: dict[str, Path],
                                                         torchrun_run: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.rollout.config import RolloutConfig
    from services.rollout.runtime import load_engine
    from services.trainer.sft.run import SFTConfig, SFTRunner

    out = sft_inputs["root"] / "single"
    runner = SFTRunner(SFTConfig.model_validate(_config(sft_inputs, out)))
    exported = runner.run()
    assert exported == out / "hf" and runner.step == 6
    trained = {k.removeprefix("lm."): v.detach() for k, v in runner.actor.named_parameters()}
    model = AutoModelForCausalLM.from_pretrained(str(exported))
    start = AutoModelForCausalLM.from_pretrained(str(sft_inputs["model"]))
    moved = 0.0
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), trained[name], atol=0, rtol=0, msg=name)
        moved = max(moved, (value.detach() - start.get_parameter(name).detach()).abs().max().item())
    assert moved > 1e-3
    # one process == two FSDP processes on the same data (global token-mean loss, same batch order)
    for name, value in torchrun_run["weights"].items():
        torch.testing.assert_close(_weights(exported)[name], value, atol=2e-5, rtol=1e-4, msg=name)
    tok = AutoTokenizer.from_pretrained(str(exported))
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    engine, _ = load_engine(RolloutConfig(model=str(exported)))  # what `retool rollout serve --model` does
    assert set(engine.weight_specs()) >= {n for n, _ in model.named_parameters()}
