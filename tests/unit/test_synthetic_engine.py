"""The synthetic engine's config, timing model and script (the contract itself: tests/integration/
test_engine_contract.py, parametrized with ``synthetic``)."""

from __future__ import annotations

import ast
import random

import pytest

from services.common.config import ConfigError
from services.rollout.engine.options import check_engine_kwargs
from services.rollout.engine.synthetic_config import PRESETS, SyntheticEngineConfig, step_seconds
from services.rollout.engine.synthetic_payload import fingerprint, payload_spec, payload_tensors
from services.rollout.engine.synthetic_script import ERRORS, SNIPPETS, answer_for, synthetic_logprob


def test_bad_engine_kwargs_are_named():
    with pytest.raises(ConfigError, match=r"engine_kwargs\.correct_rate"):
        check_engine_kwargs("synthetic", {"correct_rate": 1.5})
    with pytest.raises(ConfigError, match=r"engine_kwargs\.no_such_knob"):
        check_engine_kwargs("synthetic", {"no_such_knob": 1})
    with pytest.raises(ConfigError, match="preset=custom needs"):
        check_engine_kwargs("synthetic", {"preset": "custom", "decode_base_ms": 1.0})
    with pytest.raises(ConfigError, match="use preset=custom"):
        check_engine_kwargs("synthetic", {"preset": "h100-7b", "decode_base_ms": 1.0})
    check_engine_kwargs("synthetic", {"preset": "h200-32b-tp4", "payload_mb": 8})


def test_timing_model_grows_with_sequences_context_and_prefill():
    t = SyntheticEngineConfig(preset="h100-7b").timing()
    one = step_seconds(t, 1, 1000, 0)
    assert step_seconds(t, 0, 0, 0) == 0.0
    assert step_seconds(t, 64, 1000, 0) > one
    assert step_seconds(t, 1, 100_000, 0) > one
    assert step_seconds(t, 1, 1000, 2048) > one
    assert step_seconds(SyntheticEngineConfig().timing(), 256, 10**6, 10**4) == 0.0  # infinite
    assert set(PRESETS) == {"infinite", "h100-7b", "h200-32b-tp4"}


def test_every_snippet_is_python_and_the_logprob_is_a_pure_function():
    for family in SNIPPETS.values():
        for code in family:
            ast.parse(code.replace("{n}", "1000"))
    for code in ERRORS:
        ast.parse(code)
    a = [synthetic_logprob(7, t, p) for t, p in [(1, 10), (2, 11), (1, 10)]]
    assert a[0] == a[2] and all(x <= 0 for x in a)
    assert synthetic_logprob(8, 1, 10) != a[0] or synthetic_logprob(8, 2, 11) != a[1]
    assert answer_for(3) != answer_for(4)


def test_payload_spec_accepts_its_own_tensors_and_the_fingerprint_follows_values():
    spec = payload_spec(72.0)  # more than one 64 MiB tensor
    tensors = payload_tensors(72.0, 1.0)
    assert len(tensors) == 2
    spec.check(tensors, complete=True)
    assert fingerprint(tensors) == fingerprint(payload_tensors(72.0, 1.0))
    assert fingerprint(tensors) != fingerprint(payload_tensors(72.0, 2.0))
    with pytest.raises(ValueError, match="incomplete"):
        spec.check(tensors[:1], complete=True)


def test_turns_are_deterministic_per_stream_and_shaped_like_retool(tmp_path_factory):
    from transformers import AutoTokenizer

    from services.rollout.engine.synthetic_script import Script
    from tests.helpers.tiny_model import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(tiny_model_dir(tmp_path_factory, "small"))
    cfg = SyntheticEngineConfig(reasoning_tokens_mean=40, tool_calls_mean=2, max_tool_calls=2)
    script = Script(tok, cfg, tok.eos_token_id)
    prompt = tok.encode("Problem #5: go.", add_special_tokens=False)
    assert script.turn(prompt, random.Random(1)) == script.turn(prompt, random.Random(1))
    texts = [tok.decode(script.turn(prompt, random.Random(s))) for s in range(40)]
    assert any(t.endswith("</code>") for t in texts) and any("\\boxed{" in t for t in texts)
    right = f"\\boxed{{{answer_for(5)}}}"
    assert any(right in t for t in texts)
    # at the cap (2 interpreter blocks in the context) the turn always answers
    blocks = tok.encode("\n<interpreter>\n1\n</interpreter>\n", add_special_tokens=False) * 2
    assert all("<answer>" in tok.decode(script.turn(prompt + blocks, random.Random(s))) for s in range(10))
