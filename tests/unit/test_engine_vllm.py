"""Pure parts of the vLLM adapter: output translation, version tags, engine settings, push checks.

The objects below stand in for vLLM's ``CompletionOutput`` / ``WeightVersionSpan`` (same attribute
names) only to pin the translation rules; the adapter itself runs against the real vLLM CPU build in
tests/integration/test_engine_contract.py and test_rollout_vllm.py.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from services.common.config import ConfigError
from services.rollout.engine.options import DEFAULT_STREAM_INTERVAL, build_engine_args, check_engine_kwargs
from services.rollout.engine.vllm_engine import (
    WORKER_EXTENSION,
    RetoolWorkerExtension,
    VersionTagger,
    to_chunk,
)
from services.rollout.engine.weight_spec import TensorSpec, WeightPushRejected, WeightSpec


def _out(token_ids, finish_reason=None, stop_reason=None, index=0, spans=None):
    logprobs = [{t: SimpleNamespace(logprob=-0.5 * (i + 1))} for i, t in enumerate(token_ids)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason,
                           stop_reason=stop_reason, weight_versions=spans)


def test_running_chunk_carries_tokens_logprobs_and_versions():
    c = to_chunk(_out([5, 6], index=2), versions=[3, 4])
    assert (c.index, c.token_ids, c.logprobs, c.versions) == (2, [5, 6], [-0.5, -1.0], [3, 4])
    assert not c.finished and c.finish_reason is None


@pytest.mark.parametrize(("finish", "stop_reason", "reason", "stop_str"), [
    ("stop", "</code>", "stop", "</code>"),
    ("stop", None, "eos", None),
    ("stop", 151645, "eos", None),
    ("length", None, "length", None),
    ("abort", None, "abort", None),
])
def test_finish_reasons_map_to_the_contract(finish, stop_reason, reason, stop_str):
    c = to_chunk(_out([7], finish, stop_reason), versions=[0])
    assert c.finished and c.finish_reason == reason and c.stop_str == stop_str


def test_vllm_error_finish_and_missing_logprobs_are_errors():
    with pytest.raises(RuntimeError, match="error"):
        to_chunk(_out([7], "error"), versions=[0])
    out = _out([1, 2])
    out.logprobs = None
    with pytest.raises(RuntimeError, match="logprobs"):
        to_chunk(out, [0, 0])


def test_version_tags_follow_the_engine_cores_spans():
    tagger = VersionTagger(initial=4)
    state = SimpleNamespace(weight_version_starts=[("default", 0), ("5", 3)])
    llm = SimpleNamespace(output_processor=SimpleNamespace(external_req_ids={"r": ["r-x"]},
                                                           request_states={"r-x": state}))
    assert tagger.tags(llm, "r", _out([1, 2])) == [4, 4]  # "default": the initial version
    assert tagger.tags(llm, "r", _out([3, 4])) == [4, 5]
    span = SimpleNamespace(version="5", start=3)  # final output: spans, state gone
    final = _out([5], "length", spans=[SimpleNamespace(version="default", start=0), span])
    llm.output_processor.request_states.clear()
    assert tagger.tags(llm, "r", final) == [5]


def test_worker_extension_is_importable_by_its_dotted_path():
    module, name = WORKER_EXTENSION.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is RetoolWorkerExtension


def test_engine_kwargs_unknown_keys_are_named():
    check_engine_kwargs("hf", {"dtype": "float32", "max_batch_size": 8})
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        check_engine_kwargs("hf", {"tensor_parallel_size": 4})
    check_engine_kwargs("vllm", {"tensor_parallel_size": 4, "gpu_memory_utilization": 0.85,
                                 "dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="tensor_paralel_size.*bogus|bogus.*tensor_paralel_size"):
        check_engine_kwargs("vllm", {"tensor_paralel_size": 4, "bogus": 1})
    with pytest.raises(ConfigError, match="worker_extension_cls.*set by the rollout service"):
        check_engine_kwargs("vllm", {"worker_extension_cls": "x.Y"})


def test_stream_interval_defaults_to_8_and_can_be_overridden(tmp_path):
    """vLLM hands a request's tokens over every ``stream_interval`` tokens: the adapter asks for 8 (our
    per-chunk cost divided by 8, docs/scale.md); ``engine_kwargs.stream_interval`` overrides it."""
    assert DEFAULT_STREAM_INTERVAL == 8
    args = build_engine_args(str(tmp_path), {}, worker_extension=WORKER_EXTENSION)
    assert args.stream_interval == 8
    args = build_engine_args(str(tmp_path), {"stream_interval": 1}, worker_extension=WORKER_EXTENSION)
    assert args.stream_interval == 1


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_a_bad_stream_interval_is_named(bad):
    with pytest.raises(ConfigError, match=r"engine_kwargs\.stream_interval: must be an integer >= 1"):
        check_engine_kwargs("vllm", {"stream_interval": bad})


def _spec() -> WeightSpec:
    return WeightSpec({"embed.weight": TensorSpec((4, 2), torch.float32),
                       "norm.weight": TensorSpec((2,), torch.float32),
                       "steps": TensorSpec((), torch.int64)}, aliases={"lm_head.weight": "embed.weight"})


def _push(**over):
    push = {"embed.weight": torch.ones(4, 2), "norm.weight": torch.ones(2), "steps": torch.tensor(3)}
    push.update(over)
    return list(push.items())


def test_weight_spec_accepts_a_complete_push_and_resolves_tied_aliases():
    spec = _spec()
    assert dict(spec.check(_push()))["norm.weight"].shape == (2,)
    loaded = dict(spec.check(_push(**{"lm_head.weight": torch.ones(4, 2)})))
    assert set(loaded) == {"embed.weight", "norm.weight", "steps"}  # the alias is not loaded twice
    # a float push into a float weight of another dtype is cast later (bf16 replica, fp32 trainer)
    spec.check(_push(**{"norm.weight": torch.ones(2, dtype=torch.bfloat16)}))
    assert spec.shapes()["lm_head.weight"] == (4, 2)
    assert spec.missing(["embed.weight"]) == ["norm.weight", "steps"]


@pytest.mark.parametrize(("push", "message"), [
    (_push(extra=torch.ones(1)), "'extra' is not a weight"),
    (_push(**{"norm.weight": torch.ones(3)}), r"'norm.weight': shape \[3\], the served model has \[2\]"),
    (_push(**{"norm.weight": torch.ones(2, dtype=torch.int32)}), "dtype int32 cannot be loaded"),
    (_push(steps=torch.tensor(1.0)), "dtype float32 cannot be loaded into the served int64"),
    (_push(**{"lm_head.weight": torch.zeros(4, 2)}), "tied to 'embed.weight'.*different values"),
    ([("embed.weight", torch.ones(4, 2)), ("steps", torch.tensor(1))], "incomplete push.*norm.weight"),
])
def test_weight_spec_rejects_bad_pushes_naming_the_tensor(push, message):
    with pytest.raises(WeightPushRejected, match=message):
        _spec().check(push)


def test_weight_spec_from_a_model_dir_matches_the_module(tmp_path):
    from transformers import AutoModelForCausalLM

    from services.models.tiny import init_model_dir

    model_dir = init_model_dir(tmp_path / "m", "tiny", seed=0)
    from_dir = WeightSpec.from_model_dir(model_dir)
    from_module = WeightSpec.from_module(AutoModelForCausalLM.from_pretrained(str(model_dir)))
    assert from_dir.tensors == from_module.tensors
    assert from_dir.aliases == from_module.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert WeightSpec.from_model_dir(model_dir, dtype=torch.bfloat16).tensors[
        "model.norm.weight"].dtype == torch.bfloat16


def test_the_compose_gpu_rollout_settings_are_accepted():
    """deploy/docker-compose.yml's GPU rollout command parses into a RolloutConfig whose engine_kwargs
    are all vLLM settings (TP 4, bf16, memory utilization, prefix caching)."""
    from pathlib import Path

    import yaml

    from services.common.config import load_config
    from services.rollout.config import RolloutConfig
    from tests.helpers.compose import compose_defaults

    compose = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "docker-compose.yml").read_text())
    command = compose["services"]["rollout"]["command"]
    sets = [compose_defaults(command[i + 1]) for i, arg in enumerate(command) if arg == "--set"]
    cfg = load_config(RolloutConfig, overrides=sets)
    assert cfg.engine == "vllm"
    assert cfg.agent.allow_degraded_sandbox is False  # a degraded sandbox is refused unless set
    assert cfg.engine_kwargs["tensor_parallel_size"] == 4
    assert cfg.engine_kwargs["enable_prefix_caching"] is True
    assert 0 < cfg.engine_kwargs["gpu_memory_utilization"] < 1
    check_engine_kwargs("vllm", cfg.engine_kwargs)
