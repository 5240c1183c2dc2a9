"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio`` × lr.

Invariant: ``lr_factor(s)`` is the factor applied to the optimizer step with 0-based index ``s``;
it rises linearly from 1/(warmup+1) to 1 over the first ``warmup`` steps, equals 1 at step
``warmup``, then follows a half cosine that would reach ``min_lr_ratio`` at step ``total`` (so the
last step, ``total - 1``, still learns; as in transformers' cosine schedule).
It depends on the step only, so a resumed run gets exactly the same rates.
"""

from __future__ import annotations

import math

import torch


def warmup_steps(total: int, ratio: float, explicit: int | None = None) -> int:
    return explicit if explicit is not None else int(total * ratio)


def lr_factor(step: int, *, total: int, warmup: int, min_lr_ratio: float = 0.0) -> float:
    if total < 1:
        raise ValueError(f"total steps must be >= 1, got {total}")
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, *, total: int, warmup: int,
                    min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total=total, warmup=warmup, min_lr_ratio=min_lr_ratio))
