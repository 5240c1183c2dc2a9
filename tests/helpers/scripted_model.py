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
from typing import Any

import torch

from services.chat.format import CODE_RESULT_TEMPLATE


def scripted_model_dir(out: Path, code: str, base_seed: int = 0, scale: float = 4.0, *,
                       turn: str | None = None, tokenizer: str = "local", size: str = "small") -> Path:
    """Build (once) a model that answers every chat prompt with ``<code>{code}</code>`` (or the text
    ``turn``), again after each interpreter result. ``tokenizer``/``size``: see ``init_model_dir``
    (``qwen2.5`` with ``mini``: the real vocabulary)."""
    from transformers import AutoTokenizer

    from services.models.tiny import init_model_dir

    if (out / "config.json").is_file():
        return out
    init_model_dir(out, size, seed=base_seed, tokenizer=tokenizer)  # type: ignore[arg-type]
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.encode(f"<code>{code}</code>" if turn is None else turn, add_special_tokens=False)
    after_tool = tok.encode(CODE_RESULT_TEMPLATE.format(output="0"), add_special_tokens=False)
    successor: dict[int, list[int]] = {_header(tok)[-1]: [ids[0]], after_tool[-1]: [ids[0]]}
    _chain(successor, ids, tok, code)
    return _write_bigram(out, successor, scale)


def branching_model_dir(out: Path, prefix: str, choices: list[str], suffix: str, *, size: str = "demo",
                        base_seed: int = 0, scale: float = 4.0) -> Path:
    """Build (once) a model that answers every chat prompt with ``prefix``, then one of ``choices``
    (each a single token) drawn uniformly at temperature 1, then ``suffix`` and ``<|im_end|>``.

    With ``\\boxed{`` / digits / ``}`` the reward of a sample is a fair die roll against the
    ground truth: groups of equal rewards (dropped by dynamic sampling) and informative ones
    both occur, at rates known in advance, from a real model through the real engine.
    """
    from transformers import AutoTokenizer

    from services.models.tiny import init_model_dir

    if (out / "config.json").is_file():
        return out
    init_model_dir(out, size, seed=base_seed)  # type: ignore[arg-type]
    tok = AutoTokenizer.from_pretrained(str(out))
    head = tok.encode(prefix, add_special_tokens=False)
    tail = tok.encode(suffix, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    options = [tok.encode(c, add_special_tokens=False) for c in choices]
    if any(len(o) != 1 for o in options):
        raise ValueError(f"every choice must be one token: {dict(zip(choices, options, strict=True))}")
    successor: dict[int, list[int]] = {_header(tok)[-1]: [head[0]]}
    _chain(successor, head, tok, prefix)
    successor[head[-1]] = [o[0] for o in options]
    for o in options:
        successor[o[0]] = [tail[0]]
    _chain(successor, tail, tok, suffix)
    return _write_bigram(out, successor, scale)


def _header(tok: Any) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)


def _chain(successor: dict[int, list[int]], ids: list[int], tok: Any, text: str) -> None:
    for a, b in zip(ids, ids[1:], strict=False):
        if successor.setdefault(a, [b]) != [b]:
            raise ValueError(f"{text!r}: token {tok.decode([a])!r} would need two successors")


def _write_bigram(out: Path, successor: dict[int, list[int]], scale: float) -> Path:
    """Zero every attention and MLP output projection (the residual stream at a position is its
    token's embedding) and align ``lm_head``'s row of each successor with its predecessor's
    embedding (several successors of one token get equal logits)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        head = torch.zeros_like(embed)
        for a, nexts in successor.items():
            for b in nexts:
                head[b] += scale * embed[a] / embed[a].norm()
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    return out
