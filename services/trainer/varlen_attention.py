"""Variable-length (packed) causal attention for CPU/any device, registered with transformers.

Invariant: for a packed row whose ``position_ids`` restart at 0 for each sequence, every
sequence attends causally to itself only, and the cost is Σ len_i² instead of (Σ len_i)² — the
dense block-diagonal mask that transformers builds for sdpa/eager computes every cross-sequence
block and throws it away. Segments are found from ``position_ids`` (a 0 starts a new sequence).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

NAME = "retool_varlen"


def _segments(position_ids: torch.Tensor) -> list[int]:
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().reshape(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], pos.numel()]
    return [e - s for s, e in zip(starts, ends, strict=True)]


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """query ``[1, H, N, D]``, key/value ``[1, Hkv, N, D]`` -> ``[1, N, H, D]``."""
    position_ids = kwargs.get("position_ids")
    if query.shape[0] != 1 or not isinstance(position_ids, torch.Tensor) or attention_mask is not None:
        raise ValueError("retool_varlen attention needs one packed row, position_ids and no attention mask")
    gqa = query.shape[1] != key.shape[1]  # grouped-query attention: SDPA broadcasts the kv heads
    outs = []
    offset = 0
    for n in _segments(position_ids):
        sl = slice(offset, offset + n)
        outs.append(F.scaled_dot_product_attention(query[:, :, sl], key[:, :, sl], value[:, :, sl],
                                                   dropout_p=dropout, is_causal=True, scale=scaling,
                                                   enable_gqa=gqa))
        offset += n
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    return NAME
