"""A tiny Qwen2 model directory built locally (nothing can be downloaded from a hub here).

``tiny_model_dir(tmp_path_factory)`` builds it once per test session and per seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_BUILT: dict[tuple[str, int], Path] = {}


def tiny_model_dir(tmp_path_factory: Any, size: str = "tiny", seed: int = 0) -> Path:
    from services.models.tiny import init_model_dir

    key = (size, seed)
    if key not in _BUILT:
        _BUILT[key] = init_model_dir(tmp_path_factory.mktemp(f"{size}-{seed}"), size, seed)  # type: ignore[arg-type]
    return _BUILT[key]


def imprint(src: Path, out: Path, sequences: list[tuple[list[int], int]], *, steps: int = 400,
            lr: float = 5e-3, seed: int = 0) -> Path:
    """Fine-tune the model in ``src`` on a few token sequences until it reproduces them, save to ``out``.

    Each sequence is ``(token_ids, start)``: the loss covers the tokens from ``start`` on (what the
    model must generate after the prompt ``token_ids[:start]``). A random tiny model never writes a
    tool call by itself; one imprinted with a tool-call trace does, through the real engine.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on busy shared cores: OpenMP barriers only slow it down
    try:
        _train(AutoModelForCausalLM.from_pretrained(src), sequences, steps, lr).save_pretrained(out)
    finally:
        torch.set_num_threads(threads)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def _train(model: Any, sequences: list[tuple[list[int], int]], steps: int, lr: float) -> Any:
    import torch

    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    batch = []
    for ids, start in sequences:
        x = torch.tensor([ids])
        labels = x.clone()
        labels[0, :start] = -100
        batch.append((x, labels))
    for _ in range(steps):
        opt.zero_grad()
        for x, labels in batch:
            model(input_ids=x, labels=labels).loss.backward()
        opt.step()
    return model.eval()
