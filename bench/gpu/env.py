"""Section 1, environment: the card, the software, NCCL, and a bf16 matmul as an achievable peak.

Invariant: nothing here needs the network or vLLM; every probe that can fail on some machine
(nvidia-smi, flash-attn, NCCL's version) records None instead of failing the section.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from importlib import metadata
from typing import Any

from bench.gpu.common import Ctx, bf16_peak_tflops, sync


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def matmul_tflops(device: str, dtype: Any, n: int, reps: int = 10) -> float:
    """Best TFLOP/s of an ``n``×``n`` matmul (what the card reaches on one big GEMM)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up (cuBLAS heuristics)
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def run(ctx: Ctx) -> None:
    import torch
    import torch.distributed as dist

    from services.trainer import varlen_attention as va

    cuda = torch.cuda.is_available()
    res: dict[str, Any] = {
        "device": ctx.device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "flash_attn": _version("flash-attn"),
        "vllm": _version("vllm"),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "nccl_available": bool(dist.is_available() and dist.is_nccl_available()),
        "torch_varlen_attn": va._torch_varlen() is not None,
    }
    try:
        res["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    except (AttributeError, RuntimeError):
        res["nccl_version"] = None
    if cuda:
        props = torch.cuda.get_device_properties(0)
        res.update(
            gpu_name=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 2),
            compute_capability=f"{props.major}.{props.minor}",
            driver=_driver(),
            cudnn=torch.backends.cudnn.version(),
            bf16_supported=torch.cuda.is_bf16_supported(),
            bf16_peak_tflops=bf16_peak_tflops(props.name),
            varlen_backends_bf16=va.available_backends("cuda", torch.bfloat16),
        )
    else:
        res.update(
            gpu_name=None,
            gpu_memory_gib=None,
            compute_capability=None,
            driver=None,
            cudnn=None,
            bf16_supported=None,
            bf16_peak_tflops=None,
            varlen_backends_bf16=va.available_backends("cpu", torch.bfloat16),
        )
    ctx.save(**res)
    if ctx.device == "cuda":
        ctx.save(matmul_bf16_tflops=round(matmul_tflops("cuda", torch.bfloat16, 8192), 1))
    else:
        ctx.save(matmul_fp32_tflops=round(matmul_tflops("cpu", torch.float32, 512, reps=3), 3))
