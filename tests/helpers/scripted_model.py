"""A real Qwen2 model whose greedy continuation is a chosen text: multi-turn tool use from weights.

A random model never writes ``<code>…</code>``, so service tests that need real tool calls through a
real engine build this: the ``small`` preset (head_dim 32, vLLM's CPU attention takes it) with every
attention and MLP output projection zeroed, so the residual stream at a position is the embedding
of its token, and an untied ``lm_head`` whose row for token ``next(t)`` is aligned with the embedding
of ``t``. Greedy decoding then follows a successor map, a bigram language model in ordinary
weights: after the prompt's last token (``\\n`` of the assistant header) it writes ``code``; after
the interpreter block (which also ends with ``\\n``) it writes it again. Nothing about the engine or
the service is scripted: the weights are loaded, served, swapped and decoded as any model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.rollout.config import CODE_RESULT_TEMPLATE


def scripted_model_dir(out: Path, code: str, base_seed: int = 0, scale: float = 4.0) -> Path:
    """Build (once) a model that answers every chat prompt with ``<code>{code}</code>``, again after
    each interpreter result."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.rollout.model_init import init_model_dir

    if (out / "config.json").is_file():
        return out
    init_model_dir(out, "small", seed=base_seed)
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = tok.encode(f"<code>{code}</code>", add_special_tokens=False)
    header = tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    after_tool = tok.encode(CODE_RESULT_TEMPLATE.format(output="0"), add_special_tokens=False)
    successor: dict[int, int] = {header[-1]: ids[0], after_tool[-1]: ids[0]}
    for a, b in zip(ids, ids[1:], strict=False):
        if successor.setdefault(a, b) != b:
            raise ValueError(f"{code!r}: token {tok.decode([a])!r} would need two successors")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        head = torch.zeros_like(embed)
        for a, b in successor.items():
            head[b] += scale * embed[a] / embed[a].norm()
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    return out
