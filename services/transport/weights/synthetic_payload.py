"""The synthetic weight set as it travels: what the trainer's ``null`` step mode pushes and what an
``engine: synthetic`` replica with ``payload_mb`` serves (its spec and fingerprint live beside the
engine, ``services/rollout/engine/synthetic_payload.py``).

Invariant: ``payload_shapes(mb)`` is the one layout of the set (float32 tensors of at most 64 MiB,
rows of 1024 values), so both sides agree on names, shapes and dtype.
"""

from __future__ import annotations

import torch

ROW = 1024
MAX_ROWS = 16384  # 64 MiB of float32 per tensor


def payload_shapes(mb: float) -> list[tuple[int, int]]:
    rows = max(1, int(mb * 2**20) // (4 * ROW))
    out = []
    while rows > 0:
        take = min(rows, MAX_ROWS)
        out.append((take, ROW))
        rows -= take
    return out


def payload_name(index: int) -> str:
    return f"synthetic.payload.{index}"


def payload_tensors(mb: float, value: float = 0.0) -> list[tuple[str, torch.Tensor]]:
    """A complete push of the synthetic weight set, every element ``value``."""
    return [(payload_name(i), torch.full(s, value, dtype=torch.float32))
            for i, s in enumerate(payload_shapes(mb))]
