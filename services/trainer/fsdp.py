"""FSDP2 wiring: process group, device mesh, per-decoder-layer + root ``fully_shard``.

Invariants: on CUDA each process uses GPU ``LOCAL_RANK`` and the model is sharded even on one rank
(``wants_fsdp``: the GPU gets the bf16 compute, the fp32 master weights stay with the optimizer);
parallel sizes are validated (``TrainerConfig.validate_parallel``) before the process
group or mesh is created; each decoder layer is its own FSDP unit and the actor (root) holds the
embeddings, final norm and LM head (the critic's root: embeddings, norm; its value head is an fp32
unit of its own, listed in ``fp32_units``); gradients are reduced in ``reduce_dtype`` (fp32 by default)
and averaged over data-parallel ranks (``step.train_step`` scales the loss accordingly).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from services.common.config import ConfigError
from services.trainer.config import FSDPConfig, TrainerConfig

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_Model = TypeVar("_Model", bound=torch.nn.Module)


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(cfg: TrainerConfig) -> tuple[int, int, DeviceMesh]:
    """Validate sizes against WORLD_SIZE, then init the process group and a 1-D dp mesh."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp, _sp = cfg.validate_parallel(world)
    backend = cfg.fsdp.backend
    if backend == "auto":
        backend = "nccl" if device_type() == "cuda" else "gloo"
    if device_type() == "cuda":  # one GPU per process: torchrun's LOCAL_RANK picks it
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        timeout = {"timeout": timedelta(seconds=cfg.fsdp.timeout_s)} if cfg.fsdp.timeout_s else {}
        dist.init_process_group(backend=backend, **timeout)
    mesh = init_device_mesh(device_type(), (dp,), mesh_dim_names=("dp",))
    return dist.get_rank(), dist.get_world_size(), mesh


def wants_fsdp(world: int) -> bool:
    """Shard with FSDP2 on more than one rank, and on a GPU even alone: it moves the model there and
    runs it in ``fsdp.param_dtype`` (bf16) with fp32 master weights."""
    return world > 1 or device_type() == "cuda"


def apply_fsdp2(actor: _Model, fsdp: FSDPConfig, mesh: DeviceMesh | None = None) -> _Model:
    """Shard every decoder layer, then the root; enable gradient checkpointing if asked.

    ``actor`` is an ``Actor`` or a ``critic.Critic`` (anything with ``lm`` and ``decoder_layers``);
    modules in its optional ``fp32_units`` are sharded first with fp32 parameters and reduction.
    """
    if fsdp.cpu_offload and device_type() == "cpu":
        raise ConfigError("fsdp.cpu_offload=true needs an accelerator (parameters already live on the CPU)")
    if fsdp.gradient_checkpointing:
        actor.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[fsdp.param_dtype], reduce_dtype=_DTYPES[fsdp.reduce_dtype])
    offload: OffloadPolicy = CPUOffloadPolicy() if fsdp.cpu_offload else OffloadPolicy()
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for unit in getattr(actor, "fp32_units", ()):
        fully_shard(unit, mesh=mesh, mp_policy=fp32, offload_policy=offload, reshard_after_forward=False)
    for layer in actor.decoder_layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=fsdp.reshard_after_forward)
    fully_shard(actor, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    return actor


def build_optimizer(actor: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(actor.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                             foreach=False)


def full_state_dict(actor: torch.nn.Module, *, on_device: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded parameters (collective: every rank must call it), copies that later optimizer steps
    do not change. On the host by default; ``on_device`` keeps them where the parameters live (a
    single-rank trainer's delta encoder compares them there)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in actor.named_parameters():
        full = getattr(p.data, "full_tensor", None)
        value = (full() if full is not None else p.data).detach()
        out[name] = value.clone() if on_device else value.cpu().clone()
    return out


def encode_on_device(where: str, device: torch.device, world: int, transport: str = "grpc") -> bool:
    """The ``weight_encode_where`` decision: ``auto`` encodes on the GPU only for one CUDA rank, where
    the unsharded master already sits on that GPU (more ranks would gather the whole model there).
    Shared-memory pushes copy host tensors and encode nothing: always host."""
    if transport != "grpc":
        return False
    if where == "auto":
        return device.type == "cuda" and world == 1
    return where == "device"
