"""Checkpoints with torch.distributed.checkpoint (DCP): model + optimizer (sharded, FSDP2-aware),
per-rank RNG states, step and user metadata; keep the last K.

Invariants
- A checkpoint directory ``step_<NNNNNNNN>`` exists only once complete: everything is written to
  ``.tmp-step_<N>``, all ranks meet at a barrier, then rank 0 writes ``meta.json`` and renames the
  directory atomically. A crash mid-save leaves only a ``.tmp-*`` directory, which is ignored
  by ``latest_checkpoint`` and removed by the next save. Every file is fsync'd before the rename
  and the parent directory after it, so a power cut cannot leave a renamed directory with
  missing data. A crash between the two renames of a re-save leaves the previous copy as
  ``.tmp-step_<N>.replaced``; it is taken as ``step_<N>`` when that is missing.
- Fault injection (tests/deploy chaos test): with ``RETOOL_FAULT_CHECKPOINT_HOLD_FILE`` set and
  that file present, rank 0 logs ``checkpoint hold`` and waits (while the file exists, at most
  300 s) after the state is written and before ``meta.json``: a kill then hits a half-written
  checkpoint, deterministically.
- Loading restores weights, optimizer state (Adam moments, step counts) and this rank's RNG
  states, and returns the saved step, so a resumed run continues exactly where it stopped.
- The RNG states are JSON (``rng/rank_<r>.json``, ``rng_state``): a checkpoint directory shared by
  every trainer node is never unpickled from. An older checkpoint's ``rng/rank_<r>.pt`` is read
  with ``weights_only=True`` only; a payload in it is refused.
- Works unchanged with and without a process group (single process, tests).
- Extra ``components`` (e.g. the PPO critic: ``{"critic": (model, optimizer)}``) are saved in the
  same DCP state under their own key and listed in ``meta.json``; loading asks for exactly the
  components it is given and names any the checkpoint lacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from services.common.logging import get_logger
from services.trainer import rng_state

_STEP_RE = re.compile(r"^step_(\d{8})$")
_REPLACED_RE = re.compile(r"^\.tmp-step_(\d{8})\.replaced$")
FAULT_HOLD_FILE = "RETOOL_FAULT_CHECKPOINT_HOLD_FILE"


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory (their entries), deepest first."""
    dirs = []
    for dirpath, _, filenames in os.walk(root):
        dirs.append(dirpath)
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        _fsync_dir(Path(d))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault_hold(step: int) -> None:
    hold = os.environ.get(FAULT_HOLD_FILE)
    if not hold or not os.path.exists(hold):
        return

    get_logger("trainer.checkpoint").warning("checkpoint hold: step %d half-written (fault injection)", step)
    deadline = time.monotonic() + 300
    while os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.2)


@dataclass
class CheckpointMeta:
    step: int
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it runs without a process group; that is intended for single-process runs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def list_checkpoints(root: str | Path) -> list[CheckpointMeta]:
    """Complete checkpoints under ``root``, oldest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    out: dict[int, CheckpointMeta] = {}
    replaced: dict[int, Path] = {}
    for child in base.iterdir():
        m = _STEP_RE.match(child.name)
        if m and (child / "meta.json").is_file():
            meta = json.loads((child / "meta.json").read_text())
            step = int(m.group(1))
            out[step] = CheckpointMeta(step=step, path=child, extra=meta.get("extra", {}))
        elif (r := _REPLACED_RE.match(child.name)) and (child / "meta.json").is_file():
            replaced[int(r.group(1))] = child
    for step, child in replaced.items():  # a re-save cut between its two renames
        if step not in out:
            meta = json.loads((child / "meta.json").read_text())
            out[step] = CheckpointMeta(step=step, path=child, extra=meta.get("extra", {}))
    return [out[k] for k in sorted(out)]


def latest_checkpoint(root: str | Path) -> CheckpointMeta | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


Components = Mapping[str, tuple[torch.nn.Module, torch.optim.Optimizer]]


def _component_states(components: Components | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (module, optim) in (components or {}).items():
        if name in ("model", "optim"):
            raise ValueError(f"component name {name!r} is reserved for the actor")
        module_sd, optim_sd = get_state_dict(module, optim)
        out[name] = {"model": module_sd, "optim": optim_sd}
    return out


def save_checkpoint(root: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    keep_last: int = 2, extra: dict[str, Any] | None = None,
                    components: Components | None = None) -> Path:
    """Collective: every rank calls it with the same ``root`` (a filesystem all ranks share)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    rank, world = _rank_world()
    base = Path(root)
    final = base / f"step_{step:08d}"
    tmp = base / f".tmp-step_{step:08d}"
    if rank == 0:
        base.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd, **_component_states(components)},
                 checkpoint_id=str(tmp / "state"))
    rng_state.save(tmp / "rng" / f"rank_{rank}.json")
    if rank == 0:
        _fault_hold(step)
    _barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": world, "extra": extra or {},
                                                   "components": sorted(components or {})}))
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (a stop right after its save): never without a copy
            old = base / f".tmp-step_{step:08d}.replaced"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(base)
        _prune(base, keep_last)
    _barrier()
    return final


def _prune(base: Path, keep_last: int) -> None:
    for old in list_checkpoints(base)[:-keep_last]:
        shutil.rmtree(old.path, ignore_errors=True)
    for child in base.iterdir():
        if child.name.startswith(".tmp-step_"):
            shutil.rmtree(child, ignore_errors=True)


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    restore_rng: bool = True, components: Components | None = None) -> CheckpointMeta:
    """Collective: restores model, optimizer and (optionally) this rank's RNG; returns the metadata."""
    ckpt = Path(path)
    meta_file = ckpt / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{ckpt} is not a complete checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    missing = sorted(set(components or {}) - set(meta.get("components", [])))
    if missing:
        raise ValueError(f"checkpoint {ckpt} holds no {', '.join(missing)} state (saved components: "
                         f"{meta.get('components', [])}); it was written by a run without it")
    rank, world = _rank_world()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, **_component_states(components)}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(ckpt / "state"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, (module, optim) in (components or {}).items():
        set_state_dict(module, optim, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optim"])
    if restore_rng:
        rng_state.restore(_saved_rng(ckpt, meta, rank, world))
    return CheckpointMeta(step=int(meta["step"]), path=ckpt, extra=meta.get("extra", {}))


def _saved_rng(ckpt: Path, meta: dict[str, Any], rank: int, world: int) -> rng_state.RngState:
    """This rank's saved RNG states (JSON; an older checkpoint's ``.pt`` with weights_only only)."""
    rng_file, legacy = ckpt / "rng" / f"rank_{rank}.json", ckpt / "rng" / f"rank_{rank}.pt"
    if meta.get("world_size") != world or not (rng_file.is_file() or legacy.is_file()):
        raise ValueError(f"checkpoint {ckpt} was saved with world size {meta.get('world_size')}, "
                         f"now {world}: RNG states cannot be restored; pass restore_rng=False to "
                         "resume anyway")
    if not rng_file.is_file():
        return rng_state.load_legacy(legacy)
    try:
        return rng_state.load(rng_file)
    except ValueError as exc:
        raise ValueError(f"{rng_file}: not a valid RNG state ({str(exc)[:300]}); pass restore_rng=False "
                         "to resume without it") from None
