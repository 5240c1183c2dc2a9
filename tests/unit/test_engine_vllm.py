"""The vLLM adapter without vLLM (no GPU / no CPU vLLM build here): it imports, and its translation of
vLLM's delta outputs into our chunks follows the engine contract. The objects below stand in for
vLLM's ``CompletionOutput`` (same attribute names), which cannot be produced without vLLM."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from services.rollout.engine.vllm_engine import WORKER_EXTENSION, RetoolWorkerExtension, to_chunk


def _out(token_ids, finish_reason=None, stop_reason=None, index=0):
    logprobs = [{t: SimpleNamespace(logprob=-0.5 * (i + 1))} for i, t in enumerate(token_ids)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=logprobs,
                           finish_reason=finish_reason, stop_reason=stop_reason)


def test_running_chunk_carries_tokens_logprobs_and_version():
    c = to_chunk(_out([5, 6], index=2), version=3)
    assert (c.index, c.token_ids, c.logprobs, c.versions) == (2, [5, 6], [-0.5, -1.0], [3, 3])
    assert not c.finished and c.finish_reason is None


@pytest.mark.parametrize(("finish", "stop_reason", "reason", "stop_str"), [
    ("stop", "</code>", "stop", "</code>"),
    ("stop", None, "eos", None),
    ("stop", 151645, "eos", None),
    ("length", None, "length", None),
    ("abort", None, "abort", None),
])
def test_finish_reasons_map_to_the_contract(finish, stop_reason, reason, stop_str):
    c = to_chunk(_out([7], finish, stop_reason), version=0)
    assert c.finished and c.finish_reason == reason and c.stop_str == stop_str


def test_missing_logprobs_is_an_error():
    out = _out([1, 2])
    out.logprobs = None
    with pytest.raises(RuntimeError, match="logprobs"):
        to_chunk(out, 0)


def test_worker_extension_is_importable_by_its_dotted_path():
    module, name = WORKER_EXTENSION.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is RetoolWorkerExtension


def test_clear_error_without_vllm(tmp_path):
    from services.rollout.engine.vllm_engine import VLLMEngine

    if importlib.util.find_spec("vllm") is None:  # the case on CPU machines (no CPU wheel on PyPI)
        with pytest.raises(RuntimeError, match="vllm is not installed"):
            VLLMEngine(tmp_path)
