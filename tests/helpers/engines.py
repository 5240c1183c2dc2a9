"""Real engines for the engine-contract tests: the transformers engine and vLLM's CPU build (float32).

vLLM starts in 20-45 s here, so a test module builds one engine per kind and shares it (module-scoped
fixture on a module event loop). ``VLLM_TEST_KWARGS`` keeps the CPU engine small and fast to start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VLLM_TEST_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,  # no torch.compile warm-up: starts faster, same numbers
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 256 << 20,
}


def make_engine(kind: str, model_dir: Path) -> Any:
    if kind == "hf":
        from services.rollout.engine.hf import HFEngine

        return HFEngine(model_dir)
    from services.rollout.engine.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, **VLLM_TEST_KWARGS)


def teacher_forced_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``log_softmax(logits)[token]`` of each of ``tokens`` after ``prompt`` (one full forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)], dim=-1)
    return steps[torch.arange(len(tokens)), torch.tensor(tokens)]


def load_reference(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def checkpoint_tensors(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The weights of a model directory, as a push would carry them (HF names, tied alias included)."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return list(tensors.items())
