"""Variable-length (packed) causal attention, registered with transformers as ``retool_varlen``.

Invariants:
- for a packed row whose ``position_ids`` restart at 0 for each sequence, every sequence attends
  causally to itself only, and the cost is Σ len_i² instead of (Σ len_i)² (the dense block-diagonal
  mask that transformers builds for sdpa/eager computes every cross-sequence block and drops it);
- the sequence boundaries (``Segments``) are found once per forward (``segments_of``: one host
  sync) and handed to every layer through the ``retool_segments`` keyword; without it a layer
  finds them from ``position_ids`` itself (a 0 starts a new sequence);
- every backend computes the same function (tests/unit/test_varlen_attention.py); the one used
  for a call is ``backend_for(query)``: a fused varlen kernel where one runs (CUDA, bf16/fp16:
  flash-attn's ``flash_attn_varlen_func`` if installed, else ``torch.nn.attention.varlen``),
  otherwise ``loop``, one SDPA call per sequence (any device, any dtype).

Decision (issue 27: a library where one exists; ours only where a benchmark says it wins):
- CPU: ours. ``bench/varlen_attention.py`` (4096 tokens, 8 sequences, 14/2 heads x 64, fp32, fwd+bwd,
  2 shared cores): loop 2.00 s; transformers' packed path for sdpa (block-diagonal mask) 8.17 s;
  flex_attention has no CPU backward; SDPA on nested tensors refuses is_causal; torch varlen_attn and
  flash-attn are CUDA-only. In a model (``bench/trainer.py --quick``, one 4096-token micro-batch):
  loop 2.36 s, sdpa + block mask 3.36 s, eager + block mask 12.2 s.
- CUDA: the fused kernel (one launch per layer, no per-sequence loop), not yet measured against the
  loop on a GPU: ``bench.gpu``'s packing section reports both (docs/gpu-check.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

NAME = "retool_varlen"
SEGMENTS_KWARG = "retool_segments"
BACKENDS = ("flash_attn", "torch_varlen", "loop")
_FUSED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Segments:
    """Sequence lengths of one packed row, on the host and as ``cu_seqlens`` (int32) on the device;
    ``backend`` pins the backend (None: ``backend_for``; benchmarks pin one to compare)."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_len: int
    backend: str | None = None


def segments_of(position_ids: torch.Tensor, backend: str | None = None) -> Segments:
    """Boundaries of a packed ``[1, N]`` row: a position 0 starts a sequence (one host sync)."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().reshape(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], pos.numel()]
    lengths = tuple(e - s for s, e in zip(starts, ends, strict=True))
    cu = torch.tensor([0, *ends], dtype=torch.int32, device=position_ids.device)
    return Segments(lengths, cu, max(lengths), backend)


@cache
def _torch_varlen() -> Callable[..., torch.Tensor] | None:
    """``torch.nn.attention.varlen.varlen_attn`` with causal masking, or None (torch < 2.10).

    torch 2.10 takes ``is_causal=True``; 2.11+ takes ``window_size=(-1, 0)`` instead."""
    try:
        # lazy: missing before torch 2.10: probed at call time (and the test swaps it)
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def run(q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float | None) -> Tensor:
        kw = dict(causal)
        if scale is not None:
            if "scale" in params:
                kw["scale"] = scale
            elif abs(scale - q.shape[-1] ** -0.5) > 1e-9:
                raise ValueError(f"this torch's varlen_attn takes no scale; the model needs {scale}")
        if q.shape[1] != k.shape[1]:
            if gqa:
                kw["enable_gqa"] = True
            else:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return varlen_attn(q, k, v, seg.cu_seqlens, seg.cu_seqlens, seg.max_len, seg.max_len, **kw)

    return run


@cache
def _flash_attn() -> Callable[..., torch.Tensor] | None:
    try:
        # lazy: flash-attn is an optional GPU-only package
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None

    def run(q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float | None) -> Tensor:
        return flash_attn_varlen_func(q, k, v, seg.cu_seqlens, seg.cu_seqlens, seg.max_len, seg.max_len,
                                      softmax_scale=scale, causal=True)

    return run


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """The backends that can run packed attention on ``device`` in ``dtype``, preferred first."""
    out = []
    if torch.device(device).type == "cuda" and dtype in _FUSED_DTYPES:
        if _flash_attn() is not None:
            out.append("flash_attn")
        if _torch_varlen() is not None:
            out.append("torch_varlen")
    out.append("loop")
    return out


def backend_for(query: torch.Tensor) -> str:
    return available_backends(query.device, query.dtype)[0]


def _loop(q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float | None, dropout: float = 0.0
          ) -> Tensor:
    """``[N, H, D]`` per sequence through SDPA (``[1, H, n, D]`` views, no copies of q/k/v)."""
    gqa = q.shape[1] != k.shape[1]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    outs = []
    offset = 0
    for n in seg.lengths:
        sl = slice(offset, offset + n)
        outs.append(F.scaled_dot_product_attention(qh[:, :, sl], kh[:, :, sl], vh[:, :, sl], is_causal=True,
                                                   dropout_p=dropout, scale=scale, enable_gqa=gqa))
        offset += n
    return torch.cat(outs, dim=2)[0].transpose(0, 1)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float | None = None,
                     backend: str | None = None, dropout: float = 0.0) -> Tensor:
    """Causal attention within each segment: ``q [N, H, D]``, ``k``/``v`` ``[N, Hkv, D]`` -> ``[N, H, D]``
    (``dropout`` > 0: the loop, the only backend here that implements it)."""
    backend = backend or ("loop" if dropout else backend_for(q))
    if backend == "loop":
        return _loop(q, k, v, seg, scale, dropout)
    if dropout:
        raise ValueError(f"varlen attention backend {backend!r} is used without dropout here")
    fn = _flash_attn() if backend == "flash_attn" else _torch_varlen() if backend == "torch_varlen" else None
    if fn is None or backend not in available_backends(q.device, q.dtype):
        raise ValueError(f"varlen attention backend {backend!r} is not available for {q.dtype} on {q.device} "
                         f"(available: {available_backends(q.device, q.dtype)})")
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), seg, scale)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query ``[1, H, N, D]``, key/value ``[1, Hkv, N, D]``
    -> ``[1, N, H, D]``."""
    position_ids = kwargs.get("position_ids")
    if query.shape[0] != 1 or not isinstance(position_ids, torch.Tensor) or attention_mask is not None:
        raise ValueError("retool_varlen attention needs one packed row, position_ids and no attention mask")
    seg = kwargs.get(SEGMENTS_KWARG)
    if not isinstance(seg, Segments):
        seg = segments_of(position_ids)
    out = packed_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), seg,
                           scaling, backend=seg.backend, dropout=dropout)
    return out.unsqueeze(0).contiguous(), None


def register() -> str:
    # lazy: transformers adds ~5 s of import; registering happens only when a model is built
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    return NAME
