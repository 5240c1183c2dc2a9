"""The engine contract (services/rollout/engine/base.py) on the real engines: the transformers engine
and vLLM's CPU build, float32, on the same ``small`` Qwen2 model (tied embeddings, head_dim 32), and
the synthetic engine serving that model's weight set (its log-probs are a function of the weights'
fingerprint, token and position: ``tests/helpers/engines.SyntheticReference``).

Every log-prob is checked against an independent teacher-forced forward of the transformers model, so
the two engines agree with each other through it. The weight-swap tests push a second model (another
seed) and the original back, in the middle of a 200-token request too. One engine per kind serves the
whole module (vLLM takes 20-45 s to start here); every test leaves model 0 served.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from services.rollout.engine.base import Engine, SamplingParams, collect
from tests.helpers.engines import checkpoint_tensors, load_reference, make_engine, teacher_forced_logprobs
from tests.helpers.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    return (tiny_model_dir(tmp_path_factory, "small", seed=0),
            tiny_model_dir(tmp_path_factory, "small", seed=1))


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["hf", "vllm", "synthetic"])
async def engine(request, models) -> AsyncIterator[Any]:
    eng = make_engine(request.param, models[0])
    eng.kind = request.param
    try:
        yield eng
    finally:
        await eng.shutdown()


@pytest.fixture(scope="module")
def refs(models, engine) -> tuple[Any, Any]:
    return load_reference(models[0], engine.kind), load_reference(models[1], engine.kind)


def _prompt(engine: Any, text: str = "Compute 2+3 with code.") -> list[int]:
    tok = engine.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def _assert_logprobs(ref: Any, prompt: list[int], token_ids: list[int], logprobs: list[float]) -> None:
    expected = teacher_forced_logprobs(ref, prompt, token_ids)
    diff = (torch.tensor(logprobs) - expected).abs().max().item()
    assert diff < ATOL, f"log-probs differ from the teacher-forced forward by {diff}"


async def test_implements_the_protocol_and_greedy_is_deterministic(engine, refs):
    assert isinstance(engine, Engine) and engine.version == 0
    prompt = _prompt(engine)
    [a] = await collect(engine, prompt, GREEDY, "g1")
    [b] = await collect(engine, prompt, GREEDY, "g2")  # vLLM: served from the prefix cache
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=ATOL)
    assert a.finish_reason == "length" and a.stop_str is None
    assert len(a.token_ids) == len(a.logprobs) == len(a.versions) == GREEDY.max_tokens
    assert set(a.versions) == {0}
    expected = teacher_forced_logprobs(refs[0], prompt, a.token_ids)
    if engine.kind != "synthetic":  # greedy: each token is the argmax of the reference's distribution
        with torch.no_grad():
            logits = refs[0](torch.tensor([prompt + a.token_ids])).logits[0, len(prompt) - 1:-1]
        assert logits.argmax(-1).tolist() == a.token_ids
    assert (torch.tensor(a.logprobs) - expected).abs().max().item() < ATOL


async def test_sampled_logprobs_equal_the_teacher_forced_forward(engine, refs):
    prompt = _prompt(engine, "Find the sum of 17 and 25.")
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=11, n=2)
    results = await collect(engine, prompt, params, "lp")
    assert len(results) == 2
    for res in results:
        assert len(res.token_ids) == len(res.logprobs) == 40
        _assert_logprobs(refs[0], prompt, res.token_ids, res.logprobs)


async def test_seeds_reproduce_and_n_samples_are_independent(engine):
    prompt = _prompt(engine)
    a = await collect(engine, prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=5, n=2), "s1")
    b = await collect(engine, prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=5, n=2), "s2")
    c = await collect(engine, prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=6, n=2), "s3")
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert a[0].token_ids != a[1].token_ids
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


async def test_vllm_streams_chunks_of_its_stream_interval(engine, refs):
    """vLLM (adapter default ``stream_interval`` 8): a sample's tokens arrive as the first token, then
    chunks of 8, then the rest; each chunk's log-probs and versions align with its tokens, and the
    whole equals the teacher-forced forward (nothing lost or duplicated by the batching)."""
    if engine.kind != "vllm":
        pytest.skip("stream_interval is vLLM's setting (the synthetic engine's is tested in its unit tests)")
    from services.rollout.engine.options import DEFAULT_STREAM_INTERVAL

    prompt = _prompt(engine)
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=11, n=2)
    sizes: dict[int, list[int]] = {0: [], 1: []}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[float]] = {0: [], 1: []}
    async for chunk in engine.generate(prompt, params, "si"):
        assert len(chunk.token_ids) == len(chunk.logprobs) == len(chunk.versions)
        sizes[chunk.index].append(len(chunk.token_ids))
        tokens[chunk.index] += chunk.token_ids
        logprobs[chunk.index] += chunk.logprobs
    for i in (0, 1):
        assert len(tokens[i]) == params.max_tokens
        assert sizes[i][0] == 1 and max(sizes[i]) == DEFAULT_STREAM_INTERVAL, sizes[i]
        _assert_logprobs(refs[0], prompt, tokens[i], logprobs[i])


async def test_stop_string_ending_inside_a_token_keeps_that_token(engine):
    prompt = _prompt(engine)
    [free] = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40), "free")
    tok = engine.tokenizer
    pieces = [tok.decode([t]) for t in free.token_ids]
    k = next(i for i, p in enumerate(pieces) if i >= 2 and len(p) >= 2 and p.isascii())
    text_before = tok.decode(free.token_ids[:k])
    stop = text_before[-3:] + pieces[k][0]  # ends after the first character of token k
    assert stop not in text_before
    [res] = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                        stop=["never-there", stop]), "stop")
    assert res.finish_reason == "stop" and res.stop_str == stop
    assert res.token_ids == free.token_ids[: k + 1]
    assert tok.decode(res.token_ids).endswith(pieces[k])
    assert len(res.logprobs) == len(res.versions) == k + 1


async def test_eos_token_ends_generation_and_is_kept(engine):
    prompt = _prompt(engine)
    [free] = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=12), "free")
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    saved = engine.eos_token_ids
    engine.eos_token_ids = {target}  # a random model never picks its real EOS greedily
    try:
        [res] = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=12), "eos")
    finally:
        engine.eos_token_ids = saved
    assert res.finish_reason == "eos" and res.stop_str is None
    assert res.token_ids == free.token_ids[: first + 1]


async def test_bad_prompt_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="prompt_ids"):
        await collect(engine, [], GREEDY, "empty")
    with pytest.raises(ValueError, match="prompt_ids"):
        await collect(engine, [10 ** 9], GREEDY, "oov")


# ---------------------------------------------------------------------------------- weight swaps
async def test_push_swaps_exactly_and_the_original_comes_back(engine, models, refs):
    prompt = _prompt(engine, "Say something.")
    [before] = await collect(engine, prompt, GREEDY, "w0")
    await engine.load_weights(checkpoint_tensors(models[1]), version=1)
    assert engine.version == 1
    [other] = await collect(engine, prompt, GREEDY, "w1")  # same prompt: no KV of the old weights reused
    assert set(other.versions) == {1}
    assert other.token_ids != before.token_ids
    _assert_logprobs(refs[1], prompt, other.token_ids, other.logprobs)  # tied lm_head included
    sampled = await collect(engine, prompt, SamplingParams(temperature=1.0, max_tokens=30, seed=2), "w1s")
    _assert_logprobs(refs[1], prompt, sampled[0].token_ids, sampled[0].logprobs)

    await engine.load_weights(checkpoint_tensors(models[0]), version=2)
    [back] = await collect(engine, prompt, GREEDY, "w2")
    assert set(back.versions) == {2}
    assert back.token_ids == before.token_ids
    assert back.logprobs == pytest.approx(before.logprobs, abs=ATOL)


async def test_malformed_push_changes_nothing(engine, models):
    prompt = _prompt(engine, "Say something.")
    version = engine.version
    [before] = await collect(engine, prompt, GREEDY, "m0")
    good = checkpoint_tensors(models[1])
    name, t = good[0]
    bad_pushes = [
        [*good, ("model.not_a_weight", t)],  # unknown name
        [(n, x[..., :-1] if i == 1 else x) for i, (n, x) in enumerate(good)],  # one wrong shape
        [(n, x.to(torch.int32) if i == 2 else x) for i, (n, x) in enumerate(good)],  # integer dtype
    ]
    for bad in bad_pushes:
        with pytest.raises((KeyError, ValueError)):
            await engine.load_weights(bad, version=version + 10)
    assert engine.version == version
    [after] = await collect(engine, prompt, GREEDY, "m1")
    assert after.token_ids == before.token_ids and set(after.versions) == {version}
    assert getattr(engine, "health_error", lambda: None)() is None


async def test_swap_in_the_middle_of_a_long_request(engine, models, refs, monkeypatch):
    """Tokens before the swap come from the old weights (over old KV), tokens after it from the new ones
    (over KV recomputed with them), and each carries the version that produced it.

    The request must run to ``max_tokens``: a random model samples one of its EOS ids at temperature 1
    about once in a few hundred tokens, and where the swap lands (so which tokens follow) depends on
    timing; this test has no EOS ids (EOS handling is the test above)."""
    monkeypatch.setattr(engine, "eos_token_ids", set())
    old_ref, new_ref = refs
    old_version = engine.version
    prompt = _prompt(engine, "Write a long answer.")
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    swap: asyncio.Task[None] | None = None
    params = SamplingParams(temperature=1.0, max_tokens=200, seed=9)
    async for chunk in engine.generate(prompt, params, "mid"):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        if swap is None and len(tokens) >= 10:  # the request keeps running while the push loads
            swap = asyncio.ensure_future(engine.load_weights(checkpoint_tensors(models[1]), old_version + 1))
    assert swap is not None
    await swap
    assert len(tokens) == 200 and engine.version == old_version + 1
    assert versions == sorted(versions) and set(versions) == {old_version, old_version + 1}, versions
    k = versions.index(old_version + 1)
    assert k >= 10
    lp = torch.tensor(logprobs)
    old = teacher_forced_logprobs(old_ref, prompt, tokens)
    new = teacher_forced_logprobs(new_ref, prompt, tokens)
    assert (lp[:k] - old[:k]).abs().max().item() < ATOL
    assert (lp[k:] - new[k:]).abs().max().item() < ATOL
    # a new request with the same prompt after the swap: new weights only (no stale prefix-cache KV)
    [fresh] = await collect(engine, prompt, SamplingParams(temperature=1.0, max_tokens=20, seed=9), "fresh")
    assert set(fresh.versions) == {old_version + 1}
    _assert_logprobs(new_ref, prompt, fresh.token_ids, fresh.logprobs)

    await engine.load_weights(checkpoint_tensors(models[0]), old_version + 2)  # as every test leaves it
