"""What every section of the GPU check shares: sizes per device, model configs, peaks, the context.

Invariants:
- ``SIZES[device]`` is the only place a section's problem size is set: ``cuda`` is the real check,
  ``cpu`` the same code on small sizes (CI runs it, so the script cannot rot between GPU loans);
- ``Ctx.save`` rewrites the section's JSON file whole (write + rename) after every measurement, so
  a section killed at its time budget still leaves what it measured;
- MFU counts model FLOPs (matmuls of the decoder and the LM head, causal attention), not what
  gradient checkpointing recomputes, against the card's dense bf16 peak (``BF16_PEAK_TFLOPS``).
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.models.tiny import PRESETS, ModelPreset

# Qwen2.5-0.5B's shape (random weights, built here: nothing is downloaded)
QWEN_05B = ModelPreset(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
MODELS: dict[str, ModelPreset] = {**PRESETS, "qwen0.5b": QWEN_05B}

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets; the first name
# that occurs in torch.cuda.get_device_name() wins (so the PCIe / NVL variants come first).
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("A6000", 155.0),
    ("RTX 4090", 165.2),
    ("V100", 125.0),
)


def bf16_peak_tflops(gpu_name: str | None) -> float | None:
    if not gpu_name:
        return None
    for key, peak in BF16_PEAK_TFLOPS:
        if key in gpu_name:
            return peak
    return None


@dataclass(frozen=True)
class Sizes:
    trainer_presets: tuple[str, ...]  # throughput runs
    reference_preset: str  # loss vs a CPU reference step
    trainer_tokens: int  # real tokens per optimizer step
    micro_batch_tokens: int  # packed micro-batch budget
    trainer_steps: int  # timed steps (after one warm-up)
    length_scale: float  # scales the RL-like sequence lengths (1.0: 114..2256 tokens)
    packing_preset: str
    packing_tokens: int
    attention_tokens: int
    reps: int
    engine_preset: str
    engine_levels: tuple[int, ...]
    engine_max_tokens: int
    weights_preset: str
    weights_repeats: int
    compute_dtype: str  # engine / packing dtype


SIZES: dict[str, Sizes] = {
    "cuda": Sizes(
        trainer_presets=("bench", "qwen0.5b"),
        reference_preset="small",
        trainer_tokens=32768,
        micro_batch_tokens=16384,
        trainer_steps=3,
        length_scale=1.0,
        packing_preset="bench",
        packing_tokens=16384,
        attention_tokens=16384,
        reps=5,
        engine_preset="bench",
        engine_levels=(1, 32, 128),
        engine_max_tokens=64,
        weights_preset="bench",
        weights_repeats=3,
        compute_dtype="bfloat16",
    ),
    "cpu": Sizes(
        trainer_presets=("tiny",),
        reference_preset="tiny",
        trainer_tokens=768,
        micro_batch_tokens=512,
        trainer_steps=2,
        length_scale=0.12,
        packing_preset="tiny",
        packing_tokens=768,
        attention_tokens=512,
        reps=2,
        engine_preset="tiny",
        engine_levels=(1, 32, 128),
        engine_max_tokens=4,
        weights_preset="tiny",
        weights_repeats=1,
        compute_dtype="float32",
    ),
}


def rl_lengths(tokens: int, scale: float, seed: int = 0) -> list[int]:
    """RL-like sequence lengths (prompt 64-256 + lognormal response 50-2000, times ``scale``) until
    their sum reaches ``tokens``."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while sum(out) < tokens:
        n = int(rng.integers(64, 257)) + int(np.clip(rng.lognormal(mean=5.8, sigma=0.9), 50, 2000))
        out.append(max(4, int(n * scale)))
    return out


def train_samples(lengths: list[int], vocab: int, seed: int = 0) -> list[Any]:
    """``TrainSample``s of random tokens: a quarter prompt (mask 0), the rest response with ±1
    advantages and rollout log-probs in [-2, 0]."""
    import torch

    from services.trainer.packing import TrainSample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=gen)
        mask = torch.zeros(n)
        mask[max(1, n // 4) :] = 1
        adv = mask * (1.0 if i % 2 else -1.0)
        rollout = -2 * torch.rand(n, generator=gen)
        out.append(TrainSample(input_ids=ids, loss_mask=mask, advantages=adv, rollout_logprobs=rollout))
    return out


def build_lm(preset: str, device: str, seed: int = 0) -> Any:
    """A randomly initialised Qwen2 causal LM of ``MODELS[preset]``, built on ``device`` in fp32."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    p = MODELS[preset]
    cfg = Qwen2Config(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=p.max_position_embeddings,
        initializer_range=p.initializer_range,
        tie_word_embeddings=p.tie_word_embeddings,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.float()


def model_flops(preset: str, lengths: list[int]) -> float:
    """Training FLOPs (forward + backward) of one pass over sequences of ``lengths``: 6 × matmul
    parameters × tokens (decoder + LM head; the embedding lookup is no matmul) + causal attention
    6 × layers × heads·head_dim × Σ n²."""
    p = MODELS[preset]
    d, hd = p.hidden_size, p.hidden_size // p.num_attention_heads
    kv = p.num_key_value_heads * hd
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * p.intermediate_size  # q, k+v, o, gate/up/down
    matmul = p.num_hidden_layers * per_layer + p.vocab_size * d
    tokens = sum(lengths)
    attention = 6 * p.num_hidden_layers * p.num_attention_heads * hd * sum(n * n for n in lengths)
    return 6.0 * matmul * tokens + attention


def peak_rss_gib() -> float:
    """This process's peak resident memory (the CPU mode's "peak memory")."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


@dataclass
class Ctx:
    """A section's run: its device, sizes, scratch directory, deadline and result file."""

    device: str
    work: Path
    out: Path
    deadline: float  # time.time() by which the section must be done
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def sizes(self) -> Sizes:
        return SIZES[self.device]

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self, **updates: Any) -> None:
        self.results.update(updates)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, default=_json_default))
        os.replace(tmp, self.out)


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
