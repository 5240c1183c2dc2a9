"""``retool demo --tokenizer qwen2.5``: the demo's model with the real Qwen2.5 tokenizer, and the SFT
data the demo trains on rendered through the real chat template.

Checked on the demo's own code path (``Demo.init_model``, ``Demo.sft_config``, the SFT loader):
- the model is the ``demo`` preset with 151,936 rows and one embedding matrix shared with the head;
- every SFT trace renders to exactly the Qwen2.5-Instruct layout (default system prompt), its ids
  round-trip through decode / encode token for token, and the loss mask is 1 on the assistant's
  tokens only (the code call, the answer, ``<|im_end|>``), 0 on the prompt and the interpreter block;
- prompts and responses fit the demo's token budgets, so no trace is dropped or cut;
- an unknown tokenizer is a config error naming the field, in the config and on the command line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from itertools import groupby
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.demo.pipeline import MAX_PROMPT_LEN, SFT_MAX_LENGTH, Demo, DemoConfig, demo_values
from services.demo.task import TaskConfig

SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(value, length) of each run of equal mask values."""
    return [(v, len(list(g))) for v, g in groupby(mask)]


def test_qwen_demo_model_and_its_sft_traces(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from services.chat.format import tool_result_ids
    from services.models.tiny import PRESETS
    from services.trainer.sft.data import load_samples

    cfg = DemoConfig(out_dir=str(tmp_path / "demo"), tokenizer="qwen2.5",
                     task=TaskConfig(sft_samples=120, rl_prompts=8, eval_prompts=8))
    demo = Demo(cfg)
    demo.prepare_data()
    init = demo.init_model()

    conf = json.loads((init / "config.json").read_text())
    demo_preset = PRESETS["demo"]
    assert conf["vocab_size"] == 151_936 and conf["tie_word_embeddings"] is True
    assert (conf["hidden_size"], conf["num_hidden_layers"]) == (demo_preset.hidden_size,
                                                                demo_preset.num_hidden_layers)
    with safe_open(str(init / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys, sorted(keys)[:5]

    tok = AutoTokenizer.from_pretrained(init)
    assert len(tok) == 151_665 and tok.eos_token == "<|im_end|>"
    sft = demo.sft_config(init)
    samples, report = load_samples(sft.data, tok, sft.agent)
    assert (report.used, report.bad, report.dropped_too_long, report.truncated) == (120, 0, 0, 0)
    assert report.longest <= SFT_MAX_LENGTH

    lines = (tmp_path / "demo" / "data" / "sft.jsonl").read_text().splitlines()
    rows = [json.loads(x)["messages"] for x in lines]
    n_code = 0
    for sample, messages in zip(samples, rows, strict=True):
        ids, mask = sample.input_ids, sample.loss_mask
        question = messages[0]["content"]
        a, b = map(int, re.fullmatch(r"What is (\d+) \* (\d+)\?", question).groups())  # type: ignore[union-attr]
        header = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                  "<|im_start|>assistant\n")
        code = f"<code>print({a}*{b})</code>"
        interpreter = f"\n<interpreter>\n{a * b}\n</interpreter>\n"
        answer = f"<answer>{a * b}</answer><|im_end|>"
        use_code = any(m["role"] == "tool" for m in messages)
        n_code += use_code
        text = tok.decode(ids)
        assert text == header + (code + interpreter if use_code else "") + answer

        prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
        assert prompt == header
        n_prompt = len(tok.encode(prompt, add_special_tokens=False))
        assert n_prompt <= MAX_PROMPT_LEN and len(ids) - n_prompt <= cfg.max_tokens
        # the segments are the rollout's: the prompt, what the model generates up to its stop, the
        # interpreter block appended by the agent, the answer and EOS. Each round-trips token for
        # token; the whole text does not: re-encoded, ``</code>`` + ``\n<interpreter>`` would fuse
        # into ``>\n``, which the rollout never produces (it stops at ``</code>``)
        pieces = [header, code, interpreter, answer] if use_code else [header, answer]
        assert _runs(mask) == [(i % 2, len(tok.encode(p, add_special_tokens=False)))
                               for i, p in enumerate(pieces)], (text, _runs(mask))
        at = 0
        for p in pieces:
            n = len(tok.encode(p, add_special_tokens=False))
            segment = ids[at:at + n]
            assert tok.decode(segment) == p
            assert tok.encode(tok.decode(segment), add_special_tokens=False) == segment
            at += n
        assert at == len(ids)
        if use_code:
            assert tool_result_ids(tok, messages[2]["content"], sft.agent) == tok.encode(
                interpreter, add_special_tokens=False)
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert trained == (code if use_code else "") + answer
    assert 0 < n_code < len(rows)

    model = Qwen2ForCausalLM.from_pretrained(init)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([samples[0].input_ids])).logits
    assert logits.shape == (1, len(samples[0]), 151_936)


def test_an_unknown_tokenizer_is_refused_naming_the_field() -> None:
    assert DemoConfig().tokenizer == "demo"  # the default demo is unchanged
    with pytest.raises(ConfigError, match=r"tokenizer: .*'demo' or 'qwen2\.5'.*gpt2"):
        load_config(DemoConfig, overrides=["tokenizer=gpt2"])
    proc = subprocess.run([sys.executable, "-m", "services.cli", "demo", "--tokenizer", "gpt2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--tokenizer: 'gpt2' is not one of demo, qwen2.5" in proc.stderr, proc.stderr[-2000:]


def test_the_qwen_demo_runs_600_sft_steps_unless_told_otherwise() -> None:
    """``retool demo --tokenizer qwen2.5`` is the run docs/qwen-tokenizer.md measured (600 SFT steps,
    the rest as the default demo); ``--set`` still wins, and the default demo keeps its 1,200."""
    qwen = load_config(DemoConfig, values=demo_values(task="multiply", tokenizer="qwen2.5", quick=False,
                                                      seed=0, out=None))
    assert (qwen.sft.steps, qwen.out_dir) == (600, "runs/demo-qwen2.5")
    assert qwen.grpo == DemoConfig().grpo
    told = load_config(DemoConfig, values=demo_values(task="multiply", tokenizer="qwen2.5", quick=False,
                                                      seed=0, out=None), overrides=["sft.steps=50"])
    assert told.sft.steps == 50
    plain = load_config(DemoConfig, values=demo_values(task="multiply", tokenizer=None, quick=False, seed=0,
                                                       out=None))
    assert plain.sft.steps == DemoConfig().sft.steps == 1200
    with pytest.raises(ConfigError, match="--tokenizer: 'gpt2'"):
        demo_values(task="multiply", tokenizer="gpt2", quick=False, seed=0, out=None)
