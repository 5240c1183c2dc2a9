"""Build a randomly initialised Qwen2-architecture model and a locally trained tokenizer.

Nothing can be downloaded from a model hub on these machines, so tests, the demo and the
benchmarks use models built here. Invariants:
- the output directory is a normal Hugging Face model directory (``from_pretrained`` works on
  it for both the model and the tokenizer, weights in safetensors);
- the same ``size`` and ``seed`` give bit-identical weights and the same tokenizer;
- the tokenizer is byte-level (every string is encodable and ``decode(encode(s)) == s``), EOS is
  ``<|im_end|>`` and the chat template is Qwen-style (``<|im_start|>role\\n...<|im_end|>``);
- the ReTool markup (``<code>``, ``</code>``, ``<interpreter>``, ``<answer>``, ``<tool_call>``
  and their closing tags) is ordinary text, not special tokens (the BPE corpus contains it, and the
  byte-level pre-tokenizer splits it as ``</`` ``code`` ``>``): stop detection works on decoded
  strings (a stop string may end in the middle of a token), so nothing depends on how the markup
  is split into tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from services.chat.qwen_template import QWEN25_MAX_POSITIONS, QWEN25_VOCAB_SIZE
from services.chat.qwen_tokenizer import build_qwen25_tokenizer
from services.common.files import make_world_readable

Size = Literal["tiny", "mini", "small", "bench", "demo"]
TokenizerKind = Literal["local", "qwen2.5"]
TOKENIZERS: tuple[str, ...] = ("local", "qwen2.5")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP = (
    "<code>",
    "</code>",
    "<interpreter>",
    "</interpreter>",
    "<answer>",
    "</answer>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ModelPreset(BaseModel):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    individual_digits: bool = False  # tokenizer splits numbers into single digits (as Qwen2's does)


PRESETS: dict[str, ModelPreset] = {
    # fast on CPU: used by unit tests and the demo
    "tiny": ModelPreset(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    ),
    # the narrowest with head_dim 32 (vLLM's CPU attention takes it): the real-vocabulary (Qwen2.5) tests
    "mini": ModelPreset(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.05,
    ),
    "small": ModelPreset(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        initializer_range=0.05,
    ),
    # `retool demo`: digits are single tokens so that copying numbers is easy to learn
    "demo": ModelPreset(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
                        individual_digits=True),
    # ~131M parameters, ~526 MB in fp32: the weight-push benchmark's payload
    "bench": ModelPreset(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
}


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """A small synthetic corpus of math, Python and ReTool markup (deterministic)."""
    rng = random.Random(seed)
    words = (
        "Let",
        "the",
        "number",
        "of",
        "solutions",
        "is",
        "We",
        "compute",
        "sum",
        "product",
        "so",
        "Therefore",
        "answer",
        "integer",
        "prime",
        "divisible",
        "by",
        "each",
        "value",
        "then",
        "find",
        "Solve",
        "following",
        "math",
        "problem",
        "step",
        "Remember",
        "put",
        "your",
        "final",
        "line",
    )
    funcs = (
        "print",
        "range",
        "len",
        "sum",
        "sorted",
        "sympy.factorint",
        "math.gcd",
        "itertools.product",
        "Fraction",
        "sympy.solve",
        "abs",
        "max",
        "min",
        "int",
        "str",
        "list",
        "set",
        "dict",
    )
    out: list[str] = []
    for _ in range(lines):
        a, b, c = rng.randint(0, 999), rng.randint(1, 99), rng.randint(0, 9)
        kind = rng.randrange(6)
        if kind == 0:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) + ".")
        elif kind == 1:
            f = rng.choice(funcs)
            out.append(
                f"<code>\nimport math, sympy\nx = {f}({a})\nfor i in range({b}):\n    x += i * {c}\n"
                f"print(x)\n</code>"
            )
        elif kind == 2:
            out.append(f"<interpreter>\n{a * b + c}\n</interpreter>")
        elif kind == 3:
            out.append(f"$\\frac{{{a}}}{{{b}}} + {c}^2 = {a / b + c * c:.4f}$ so \\boxed{{{a + c}}}")
        elif kind == 4:
            out.append(f"<answer>\\boxed{{{a - b}}}</answer>\nAnswer: {a - b}")
        else:
            out.append(
                f'<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "print({a}+{b})"}}}}'
                f"\n</tool_call>\n<tool_response>\n{a + b}\n</tool_response>"
            )
    out.extend(MARKUP)
    return out


def build_tokenizer(vocab_size: int, seed: int = 0, individual_digits: bool = False,
                    extra_corpus: Sequence[str] = ()) -> Any:
    """A byte-level BPE tokenizer trained on the synthetic corpus, as a PreTrainedTokenizerFast.

    With ``individual_digits`` every digit is its own pre-token (no merges across digits).
    ``extra_corpus``: more training lines (a task's own texts, so they get merges); without them
    the tokenizer is exactly the one of the synthetic corpus alone.
    """
    # lazy: tokenizers and transformers (~5 s): the CLI reads PRESETS at start without them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if individual_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator([*_corpus(seed), *extra_corpus], trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(size: Size, tokenizer: Any, seed: int = 0, *, vocab_size: int | None = None,
                tie_word_embeddings: bool | None = None, max_position_embeddings: int | None = None) -> Any:
    """``vocab_size``: embedding rows (default ``len(tokenizer)``; Qwen2.5 pads to 151,936);
    ``tie_word_embeddings``, ``max_position_embeddings``: default the preset's."""
    # lazy: torch and transformers (~5 s): the CLI reads PRESETS at start without them
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    preset = PRESETS[size]
    rows = len(tokenizer) if vocab_size is None else vocab_size
    tie = preset.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
    if rows < len(tokenizer):
        raise ValueError(f"vocab_size: {rows} rows cannot hold the tokenizer's {len(tokenizer)} ids")
    cfg = Qwen2Config(
        vocab_size=rows,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=max_position_embeddings or preset.max_position_embeddings,
        initializer_range=preset.initializer_range,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.eval()
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def init_model_dir(
    out: str | Path, size: Size = "tiny", seed: int = 0, extra_corpus: Sequence[str] = (), *,
    tokenizer: TokenizerKind = "local", tie_word_embeddings: bool | None = None,
) -> Path:
    """Create ``out`` with model weights (safetensors), config, generation config and tokenizer.

    ``tokenizer``: ``local`` trains the preset's small BPE (``extra_corpus``: see ``build_tokenizer``);
    ``qwen2.5`` is the real Qwen2.5 tokenizer and chat template (services/chat/qwen_tokenizer.py) with
    151,936 embedding rows, untied unless ``tie_word_embeddings``.
    """
    if size not in PRESETS:
        raise ValueError(f"size: {size!r} is not one of {sorted(PRESETS)}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer: {tokenizer!r} is not one of {list(TOKENIZERS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer == "qwen2.5":
        if extra_corpus:
            raise ValueError("extra_corpus: the qwen2.5 tokenizer is fixed (no training corpus)")
        tok = build_qwen25_tokenizer()
        tie = False if tie_word_embeddings is None else tie_word_embeddings
        model = build_model(size, tok, seed=seed, vocab_size=QWEN25_VOCAB_SIZE, tie_word_embeddings=tie,
                            max_position_embeddings=QWEN25_MAX_POSITIONS)
    else:
        tok = build_tokenizer(
            PRESETS[size].vocab_size, seed=0, individual_digits=PRESETS[size].individual_digits,
            extra_corpus=extra_corpus,
        )
        model = build_model(size, tok, seed=seed, tie_word_embeddings=tie_word_embeddings)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "retool_model.json").write_text(json.dumps({"size": size, "seed": seed, "parameters": n_params,
                                                       "tokenizer": tokenizer}))
    make_world_readable(out)  # the containers (uid 10001) read it through a bind mount
    return out
