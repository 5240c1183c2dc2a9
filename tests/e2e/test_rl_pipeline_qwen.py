"""End to end on the real Qwen2.5 vocabulary (151,936 untied rows, the Instruct chat template): a
short twin of test_rl_pipeline.py, reusing its run config and trainer launcher.

All real: sandbox, reward, Redis, a rollout replica (HF engine) and a 2-process gloo trainer under
torchrun, two GRPO steps, each followed by a weight push over gRPC. The model is a scripted
``mini`` model on the real tokenizer (tests/helpers/scripted_model.py) that writes a Python tool call
after the prompt and after each interpreter result, so every response runs code in the sandbox,
gets the interpreter output tokenized into it, and is graded; the trainer starts from the same
weights, so its log-probs of the sampled ids must agree with the replica's. No timing asserts.
"""

from __future__ import annotations

import asyncio

import pytest
import yaml

from services.transport.weights.client import get_version
from tests.e2e.test_rl_pipeline import TOKEN, _config, _steps, _trainer
from tests.helpers import agent_fixtures
from tests.helpers.qwen import qwen_scripted_dir
from tests.helpers.rl_stack import rl_stack

pytestmark = pytest.mark.e2e
reward_url = agent_fixtures.reward_url
TURN = "<code>print(6*7)</code>"  # the real merges: `)</` `code` `>`
STEPS = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory, sandbox_url, reward_url):
    tmp = tmp_path_factory.mktemp("e2e-qwen")
    model = qwen_scripted_dir(tmp_path_factory, TURN)
    with rl_stack(tmp, model, sandbox_url, reward_url, TOKEN) as services:
        yield services


async def test_rl_steps_on_the_real_qwen_vocabulary(stack):
    tmp = stack["tmp"]
    path = _config(stack, max_steps=STEPS, save_freq=STEPS)
    cfg = yaml.safe_load(path.read_text())
    cfg["val_dataset"] = None  # short: training steps only
    cfg["max_turns"] = 1  # one tool call runs; the second is refused (finish reason max_turns)
    cfg["sampling"]["max_tokens"] = 96
    cfg["trainer"]["max_response_len"] = 256
    path.write_text(yaml.safe_dump(cfg))
    log = tmp / "trainer.log"
    proc = await _trainer(path, log)
    assert await asyncio.wait_for(proc.wait(), 900) == 0, log.read_text()[-3000:]
    assert await get_version(stack["grpc"]) == STEPS
    metrics = [m for m in _steps(tmp / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert m["rollout/tool_use_rate"] == 1.0, m  # the sandbox ran in every response
        assert m["rollout/tool_calls_mean"] == 1.0, m
        assert m["mismatch/tokens"] > 0 and m["mismatch/abs_mean"] < 1e-3, m  # same ids, same model
