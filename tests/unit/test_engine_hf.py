"""The transformers engine on a real (tiny, randomly initialised) Qwen2 model: what only it does.

The contract both engines share (seeds and ``n``, stop strings, EOS, bad prompts, log-probs, swaps)
is tested on both in ``tests/integration/test_engine_contract.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.rollout.engine.base import Engine, SamplingParams, collect
from services.rollout.engine.hf import HFEngine
from tests.helpers.tiny_model import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture
async def engine(model_dir) -> AsyncIterator[HFEngine]:
    eng = HFEngine(model_dir)
    try:
        yield eng
    finally:
        await eng.shutdown()


def _prompt(engine: HFEngine, text: str = "Compute 2+3 with code.") -> list[int]:
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


async def test_implements_engine_protocol(engine):
    assert isinstance(engine, Engine)
    assert engine.version == 0


async def test_greedy_matches_transformers_generate(engine):
    prompt = _prompt(engine)
    [res] = await collect(engine, prompt, GREEDY, "g1")
    [again] = await collect(engine, prompt, GREEDY, "g2")
    assert res.token_ids == again.token_ids
    # independent reference: transformers' own greedy generate on the same weights
    with torch.no_grad():
        ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=len(res.token_ids),
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ref[0, len(prompt):].tolist() == res.token_ids
    assert res.finish_reason == "length" and len(res.token_ids) == GREEDY.max_tokens


async def test_logprobs_match_full_forward_recomputation(engine):
    prompt = _prompt(engine)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20, seed=11)
    [res] = await collect(engine, prompt, params, "lp")
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + res.token_ids])).logits[0].float()
    steps = logits[len(prompt) - 1: len(prompt) - 1 + len(res.token_ids)]
    expected = torch.log_softmax(steps / params.temperature, dim=-1)
    expected = expected[torch.arange(len(res.token_ids)), torch.tensor(res.token_ids)]
    assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4)
    # greedy log-probs are under the untempered distribution
    [g] = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=1), "lp0")
    first = torch.log_softmax(logits[len(prompt) - 1], dim=-1)
    assert g.token_ids == [int(first.argmax())]
    assert abs(g.logprobs[0] - float(first.max())) < 1e-4


async def test_max_tokens_gives_length(engine):
    [res] = await collect(engine, _prompt(engine), SamplingParams(temperature=1.0, max_tokens=7, seed=1), "m")
    assert res.finish_reason == "length"
    assert len(res.token_ids) == len(res.logprobs) == len(res.versions) == 7


async def test_concurrent_requests_batch_to_the_same_greedy_outputs(engine):
    prompts = [_prompt(engine, "x" * i + " what is 7*6?") for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=40 - 3 * i) for i in range(6)]
    sequential = [(await collect(engine, p, sp, f"seq{i}"))[0].token_ids
                  for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    started = asyncio.Event()

    async def run(i: int) -> list[int]:
        if i >= 3:  # the second half joins a batch that is already decoding
            await started.wait()
        out: list[int] = []
        async for chunk in engine.generate(prompts[i], params[i], f"par{i}"):
            out.extend(chunk.token_ids)
            started.set()
        return out

    batched_steps = []
    original = engine._decode

    def spy(seqs):
        batched_steps.append(len(seqs))
        return original(seqs)

    engine._decode = spy
    concurrent = await asyncio.gather(*(run(i) for i in range(6)))
    assert concurrent == sequential
    assert max(batched_steps) >= 4  # really decoded together, late joiners included


async def test_abandoned_stream_does_not_block_others(engine):
    prompt = _prompt(engine)
    agen = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=500), "abandon")
    await agen.__anext__()
    await agen.aclose()
    [res] = await asyncio.wait_for(collect(engine, prompt, GREEDY, "after"), 30)
    assert len(res.token_ids) == GREEDY.max_tokens
    assert engine._active == []


async def test_load_weights_switches_version_between_steps(engine):
    prompt = _prompt(engine)
    new = {name: p.detach().clone() + 0.05 for name, p in engine.model.named_parameters()}
    versions: list[int] = []
    agen = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=60, seed=2), "v")
    async for chunk in agen:
        versions.extend(chunk.versions)
        if len(versions) == 5:
            await engine.load_weights(new.items(), version=7)
    assert versions[:5] == [0] * 5 and versions[-1] == 7
    assert versions == sorted(versions)
    assert engine.version == 7
    name, param = next(iter(engine.model.named_parameters()))
    assert torch.equal(param.detach(), new[name])


async def test_load_weights_rejects_bad_input_atomically(engine):
    name, param = next(iter(engine.model.named_parameters()))
    before = param.detach().clone()
    with pytest.raises(KeyError, match="nope"):
        await engine.load_weights([(name, before + 1), ("nope", before)], version=3)
    with pytest.raises(ValueError, match="shape"):
        await engine.load_weights([(name, before + 1), (name, torch.zeros(1))], version=3)
    assert engine.version == 0 and torch.equal(param.detach(), before)
