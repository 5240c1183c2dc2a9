"""Packed (varlen) causal attention: our per-sequence SDPA loop vs every alternative, one run.

One packed row of RL-like sequences (prompt 64-256 tokens + lognormal response, ``--tokens`` or a
little more), attention only (no model around it), forward + backward, best of ``--reps`` after a
warm-up. Arms, each reported as seconds and as a ratio to ``loop`` (> 1: faster than ours):
- ``loop``: ours (``services/trainer/varlen_attention.py``), segments found once per forward;
- ``loop, segments per layer``: the same with the boundaries found in every call (the host sync per
  layer that the trainer had before);
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash kernel; CUDA, bf16/fp16);
- ``flash_attn``: ``flash_attn_varlen_func`` (when the package is installed; CUDA);
- ``sdpa + block mask``: what transformers does for a packed row under sdpa (a dense
  block-diagonal causal mask, (Σ n)² work);
- ``flex_attention``: a document-causal block mask (compiled on CUDA; eager elsewhere);
- ``sdpa on nested tensors``: jagged NJT (torch refuses ``is_causal`` for nested inputs today).
Every arm's output is compared with ``loop`` (max |Δ|). An arm that cannot run records its error.

    .venv/bin/python bench/varlen_attention.py                     # CPU, fp32
    python bench/varlen_attention.py --device cuda --dtype bfloat16 --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from bench.gpu.common import rl_lengths  # noqa: E402
from services.trainer import varlen_attention as va  # noqa: E402

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _block_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, device=device))
    n = seq.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return causal & (seq[:, None] == seq[None, :])


def arms(lengths: list[int], device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], Fn]]:
    """Name -> a builder of ``f(q, k, v)`` on ``[N, H, D]`` / ``[N, Hkv, D]`` (building may raise)."""
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    seg = va.segments_of(pos)

    def backend(name: str) -> Callable[[], Fn]:
        def build() -> Fn:
            if name not in va.available_backends(device, dtype):
                raise RuntimeError(f"not available for {dtype} on {device.type} "
                                   f"(available: {va.available_backends(device, dtype)})")
            return lambda q, k, v: va.packed_attention(q, k, v, seg, backend=name)
        return build

    def per_layer() -> Fn:
        return lambda q, k, v: va.packed_attention(q, k, v, va.segments_of(pos), backend="loop")

    def block_mask() -> Fn:
        mask = _block_mask(lengths, device)
        return lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1)

    def flex() -> Fn:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                      torch.tensor(lengths, device=device))

        def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            return (qi >= ki) & (doc[qi] == doc[ki])

        n = doc.numel()
        block = create_block_mask(mask_mod, None, None, n, n, device=device.type)
        attend = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
        def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
            gqa = q.shape[1] != k.shape[1]
            return attend(qh, kh, vh, block_mask=block, enable_gqa=gqa)[0].transpose(0, 1)
        return f

    def nested() -> Fn:
        def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            def njt(x: torch.Tensor) -> torch.Tensor:
                parts = list(torch.split(x, lengths))
                return torch.nested.as_nested_tensor(parts, layout=torch.jagged).transpose(1, 2)
            out = F.scaled_dot_product_attention(njt(q), njt(k), njt(v), is_causal=True,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            return out.transpose(1, 2).values()
        return f

    return {"loop": backend("loop"), "loop, segments per layer": per_layer,
            "torch_varlen": backend("torch_varlen"), "flash_attn": backend("flash_attn"),
            "sdpa + block mask": block_mask, "flex_attention": flex, "sdpa on nested tensors": nested}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _run(fn: Fn, q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, grad: torch.Tensor,
         dev: torch.device) -> tuple[float, torch.Tensor]:
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q0, k0, v0))
    _sync(dev)
    t0 = time.perf_counter()
    o = fn(q, k, v)
    o.backward(grad)
    _sync(dev)
    return time.perf_counter() - t0, o.detach().float()


def measure(tokens: int, heads: int, kv_heads: int, head_dim: int, device: str, dtype: torch.dtype,
            reps: int = 3, only: list[str] | None = None, deadline: float | None = None,
            scale: float = 1.0) -> dict[str, Any]:
    """Seconds (forward + backward; best and median of ``reps``, arms interleaved) per arm and the
    ratio ``loop`` / arm (from the best times)."""
    dev = torch.device(device)
    lengths = rl_lengths(tokens, scale)
    tokens = sum(lengths)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q0 = torch.randn(tokens, heads, head_dim, generator=gen).to(dev, dtype)
    k0 = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dev, dtype)
    v0 = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dev, dtype)
    grad = torch.randn(tokens, heads, head_dim, generator=gen).to(dev, dtype)
    out: dict[str, Any] = {"tokens": tokens, "sequences": len(lengths), "max_len": max(lengths),
                           "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "device": dev.type,
                           "dtype": str(dtype).removeprefix("torch."), "arms": {}}
    fns: dict[str, Fn] = {}
    builders = arms(lengths, dev, dtype)
    for name, build in builders.items():
        if only and name not in only:
            continue
        if deadline is not None and time.monotonic() > deadline:
            out["arms"][name] = {"error": "skipped: out of time"}
            continue
        try:
            fns[name] = build()
            _run(fns[name], q0, k0, v0, grad, dev)  # warm-up: compiles, autotunes; not timed
        except Exception as exc:  # an arm that cannot run here is reported, not fatal
            fns.pop(name, None)
            out["arms"][name] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"}
    times: dict[str, list[float]] = {name: [] for name in fns}
    outputs: dict[str, torch.Tensor] = {}
    names = list(fns)
    for rep in range(reps):  # interleaved, rotating order: machine noise hits every arm alike
        if deadline is not None and time.monotonic() > deadline and rep:
            break
        for j in range(len(names)):
            name = names[(rep + j) % len(names)]
            seconds, outputs[name] = _run(fns[name], q0, k0, v0, grad, dev)
            times[name].append(seconds)
    ref = outputs.get("loop")
    for name in names:
        arm = {"seconds": min(times[name]), "median_seconds": statistics.median(times[name])}
        if ref is not None:
            arm["max_abs_diff_vs_loop"] = float((outputs[name] - ref).abs().max())
        out["arms"][name] = arm
    out["arms"] = {n: out["arms"][n] for n in builders if n in out["arms"]}
    base = out["arms"].get("loop", {}).get("seconds")
    for arm in out["arms"].values():
        if base and "seconds" in arm:
            arm["speedup_vs_loop"] = round(base / arm["seconds"], 3)
    timed = {k: a["seconds"] for k, a in out["arms"].items() if "seconds" in a}
    out["fastest"] = min(timed, key=timed.__getitem__) if timed else None
    out["default_backend"] = va.available_backends(dev, dtype)[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    res = measure(args.tokens, args.heads, args.kv_heads, args.head_dim, args.device,
                  getattr(torch, args.dtype), args.reps)
    print(f"{res['sequences']} sequences in {res['tokens']} tokens (longest {res['max_len']}), "
          f"{res['heads']}/{res['kv_heads']} heads x {res['head_dim']}, {res['dtype']} on {res['device']}, "
          f"fwd+bwd, {args.reps} interleaved reps; torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    for name, arm in res["arms"].items():
        if "seconds" in arm:
            print(f"  {name:<28}{arm['seconds']:9.4f} s best {arm['median_seconds']:9.4f} s median  "
                  f"{arm['speedup_vs_loop']:6.2f}x loop  max|Δ| {arm['max_abs_diff_vs_loop']:.1e}")
        else:
            print(f"  {name:<28}unavailable: {arm['error']}")
    print(f"fastest: {res['fastest']}; the trainer's default here: {res['default_backend']}")
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
