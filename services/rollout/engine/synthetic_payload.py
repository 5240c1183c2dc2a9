"""The synthetic weight set: what a push to ``engine: synthetic`` with ``payload_mb`` carries, and the
fingerprint that ties generated tokens to the weights that produced them.

Invariants: ``payload_spec(mb)`` and ``payload_tensors(mb, ...)`` agree on names, shapes and dtype
(float32 tensors of at most 64 MiB, rows of 1024 values), so the trainer's ``null`` step mode can push
exactly what a synthetic replica serves; ``fingerprint`` depends on the names and on sampled values of
every tensor (same weights, same fingerprint), never on all the bytes (a 60 GB push hashes in
microseconds).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

from services.rollout.engine.weight_spec import TensorSpec, WeightSpec
from services.transport.weights.synthetic_payload import payload_name, payload_shapes, payload_tensors

__all__ = ["fingerprint", "payload_spec", "payload_tensors"]


def payload_spec(mb: float) -> WeightSpec:
    shapes = enumerate(payload_shapes(mb))
    return WeightSpec({payload_name(i): TensorSpec(s, torch.float32) for i, s in shapes})


def fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """A 32-bit digest of the names and of up to 64 values at both ends of each tensor."""
    crc = 0
    for name, t in sorted(named_tensors, key=lambda nt: nt[0]):
        flat = t.detach().reshape(-1)
        crc = zlib.crc32(name.encode(), crc)
        for part in (flat[:64], flat[-64:]):
            crc = zlib.crc32(part.contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc
