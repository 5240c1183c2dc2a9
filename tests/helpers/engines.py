"""Real engines for the engine-contract tests: the transformers engine, vLLM's CPU build (float32) and
the synthetic engine (no model: its reference log-probs are its policy function, ``SyntheticReference``).

vLLM starts in 20-45 s here, so a test module builds one engine per kind and shares it (module-scoped
fixture on a module event loop). ``VLLM_TEST_KWARGS`` keeps the CPU engine small and fast to start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.rollout.engine.base import GenerationChunk

VLLM_TEST_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,  # no torch.compile warm-up: starts faster, same numbers
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 256 << 20,
}


# 2 ms a step: a 200-token request lasts long enough for a push to land in its middle
SYNTHETIC_TEST_KWARGS: dict[str, Any] = {"preset": "custom", "decode_base_ms": 2.0, "decode_per_seq_us": 0.0,
                                         "decode_per_kv_token_ns": 0.0, "prefill_per_token_us": 0.0}


class SyntheticReference:
    """The teacher-forced reference of the synthetic engine serving a model directory's weights: its
    log-prob is a pure function of (weights fingerprint, token, position)."""

    def __init__(self, model_dir: Path) -> None:
        from services.rollout.engine.synthetic_payload import fingerprint
        from services.rollout.engine.weight_spec import WeightSpec

        served = WeightSpec.from_model_dir(model_dir).check(checkpoint_tensors(model_dir))
        self.fingerprint = fingerprint(served)


def make_engine(kind: str, model_dir: Path) -> Any:
    if kind == "synthetic":
        from services.rollout.engine.synthetic import SyntheticEngine

        return SyntheticEngine(model_dir, **SYNTHETIC_TEST_KWARGS)
    if kind == "hf":
        from services.rollout.engine.hf import HFEngine

        return HFEngine(model_dir)
    from services.rollout.engine.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, **VLLM_TEST_KWARGS)


def teacher_forced_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``log_softmax(logits)[token]`` of each of ``tokens`` after ``prompt`` (one full forward)."""
    if isinstance(model, SyntheticReference):
        from services.rollout.engine.synthetic_script import synthetic_logprob

        return torch.tensor([synthetic_logprob(model.fingerprint, t, len(prompt) + i)
                             for i, t in enumerate(tokens)], dtype=torch.float64)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)], dim=-1)
    return steps[torch.arange(len(tokens)), torch.tensor(tokens)]


def load_reference(model_dir: Path, kind: str = "hf") -> Any:
    if kind == "synthetic":
        return SyntheticReference(model_dir)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def checkpoint_tensors(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The weights of a model directory, as a push would carry them (HF names, tied alias included)."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return list(tensors.items())


def scripted_chunk(part: list[int], logprobs: list[float], version: int, last: bool,
                   stop_str: str | None) -> GenerationChunk:
    """One chunk of a scripted engine's turn: on its last chunk the turn ends at ``stop_str``
    (``stop``) or, without one, at EOS; every token carries ``version``."""
    return GenerationChunk(index=0, token_ids=part, logprobs=logprobs, versions=[version] * len(part),
                           finished=last, finish_reason=("stop" if stop_str else "eos") if last else None,
                           stop_str=stop_str if last else None)
