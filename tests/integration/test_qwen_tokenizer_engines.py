"""Token-in/token-out with the real Qwen2.5 tokenizer on both real engines: transformers and vLLM's
CPU build (float32), on ``mini`` models with 151,936 untied rows.

The models are scripted (tests/helpers/scripted_model.py: a bigram model in ordinary weights, since
a random model never writes ``</code>``): greedy decoding writes a fenced code block closed by
``</code>`` fused by the BPE with what follows (``>\\n\\n``, ``>The``, ``>.``: the stop string ends
inside the token), after the prompt and again after every interpreter result. One engine per
kind serves the module; each variant's weights are pushed into it (``load_weights``).

For every variant and engine: each turn keeps exactly the tokens the engine sampled (the token
that completes ``</code>`` included, nothing after it), each next turn is generated from exactly
``prompt + response so far`` (recorded at the engine), every log-prob matches a teacher-forced
forward of the transformers model over the final ids, and the trainer's tokens (RL batch and SFT
rendering) are the rollout's, id for id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from services.chat.format import tool_result_ids
from services.rollout.agent.loop import AgentLoop
from services.rollout.agent.sandbox import ToolResult
from services.rollout.config import AgentConfig
from services.rollout.engine.base import SamplingParams
from services.trainer.batch import Rollout, build_samples
from services.trainer.sft.render import render
from tests.helpers.engines import checkpoint_tensors, load_reference, make_engine, teacher_forced_logprobs
from tests.helpers.masks import spans
from tests.helpers.qwen import qwen_scripted_dir

# vLLM with a 151,665-token tokenizer starts slowly on busy CPUs (its renderer deep-copies the tokenizer)
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(1500),
              pytest.mark.slow(reason="the first vLLM test starts vLLM with the 151,665-token tokenizer "
                               "(its renderer deep-copies it; 903 s for the vLLM tests at load 12)",
                               budget_s=1200)]

ATOL = 1e-4
MESSAGES = [{"role": "user", "content": "Compute 6*7 with code."}]
# the model's turn: its last token holds the end of "</code>" and more
TURNS = {
    "newlines": ("```\nprint(6*7)\n```</code>\n\n", ">\n\n"),
    "text": ("```\nprint(6*7)\n```</code>The", ">The"),
    "period": ("```\nprint(6*7)\n```</code>.", ">."),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {name: qwen_scripted_dir(tmp_path_factory, turn) for name, (turn, _) in TURNS.items()}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["hf", "vllm"])
async def engine(request, models) -> AsyncIterator[Any]:
    eng = make_engine(request.param, models["newlines"])
    try:
        yield eng
    finally:
        await eng.shutdown()


class Recording:
    """The real engine, with each call's prompt ids and streamed token ids written down."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.prompts, self.sampled = engine, [], []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[Any]:
        self.prompts.append(list(prompt_ids))
        self.sampled.append([])
        async for chunk in self.engine.generate(prompt_ids, params, request_id):
            self.sampled[-1].extend(chunk.token_ids)
            yield chunk


class Outputs:
    def __init__(self) -> None:
        self.codes: list[str] = []

    async def run(self, code: str) -> ToolResult:
        self.codes.append(code)
        return ToolResult("42 — 四十二 😀\n", False, 0.001)


@pytest.mark.parametrize("variant", list(TURNS))
async def test_stop_inside_a_merged_token_keeps_the_sampled_ids_and_the_next_turn_continues_from_them(
        engine, models, variant):
    version = 1 + list(TURNS).index(variant)
    await engine.load_weights(checkpoint_tensors(models[variant]), version=version)
    tok = engine.tokenizer
    turn, stop_token = TURNS[variant]
    cfg = AgentConfig(max_turns=2, max_response_tokens=400)
    rec = Recording(engine)
    loop = AgentLoop(rec, tok, Outputs(), cfg)
    prompt = loop.build_prompt(MESSAGES)
    traj = await loop.run_one(prompt, sampling=None)
    turn_ids = tok.encode(turn, add_special_tokens=False)
    result = tool_result_ids(tok, "42 — 四十二 😀\n", cfg)
    assert tok.decode(turn_ids[-1:]) == stop_token
    assert traj.finish_reason == "max_turns" and traj.tool_calls == 2 and traj.tool_errors == 0
    # kept = sampled: every turn is the engine's tokens through the one completing "</code>"
    assert rec.sampled == [turn_ids, turn_ids, turn_ids]
    assert [traj.response_ids[a:b] for a, b in spans(traj.loss_mask)] == rec.sampled
    assert traj.response_ids == turn_ids + result + turn_ids + result + turn_ids
    # each turn generated from exactly the ids so far
    assert rec.prompts == [prompt, prompt + turn_ids + result, prompt + 2 * (turn_ids + result)]
    assert set(traj.versions) == {version, -1}
    # log-probs: a teacher-forced forward of the transformers model over the final ids
    ref = load_reference(models[variant])
    expected = teacher_forced_logprobs(ref, prompt, traj.response_ids)
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    diff = (torch.tensor(traj.logprobs)[mask] - expected[mask]).abs().max().item()
    assert diff < ATOL
    # the trainer's tokens: the RL batch uses the ids as given; SFT renders the same messages to them
    [sample], _ = build_samples([Rollout("g", prompt, traj.response_ids, traj.loss_mask, 1.0, traj.logprobs)])
    assert sample.input_ids.tolist() == prompt + traj.response_ids
    assert sample.loss_mask.tolist() == [0.0] * len(prompt) + [float(m) for m in traj.loss_mask]
    messages = [*MESSAGES]
    for _ in range(2):
        messages += [{"role": "assistant", "content": turn}, {"role": "tool", "content": "42 — 四十二 😀\n"}]
    messages.append({"role": "assistant", "content": turn})
    sft = render(messages, tok, cfg, append_eos=False)
    assert sft.input_ids == prompt + traj.response_ids
    assert sft.loss_mask == [0] * len(prompt) + traj.loss_mask
