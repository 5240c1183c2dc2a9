"""One rank's RNG states (torch, CUDA, numpy, Python) as a JSON file of a checkpoint.

Invariants
- The file is JSON validated by ``RngState``: nothing in a checkpoint directory (often a shared
  volume every trainer node mounts) is ever unpickled. Byte states are base64, integer states lists.
- A checkpoint written before this format holds ``rank_<r>.pt`` (a ``torch.save`` pickle). It is
  read with ``torch.load(weights_only=True)``, allowing only numpy's array reconstruction (the
  numpy state is an array); anything else in it (a planted ``__reduce__`` payload) is refused with
  a ``ValueError`` naming the file, and no code of it runs.
"""

from __future__ import annotations

import base64
import pickle
import random
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

_U32 = Annotated[int, Field(ge=0, lt=2**32)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NumpyState(_Strict):
    """``np.random.get_state()``'s legacy tuple, field by field."""

    bit_generator: Literal["MT19937"] = "MT19937"
    keys: list[_U32] = Field(min_length=624, max_length=624)
    pos: int = Field(ge=0, le=624)
    has_gauss: int = Field(ge=0, le=1)
    cached_gaussian: float


class PythonState(_Strict):
    """``random.getstate()``: (version, 625 words, gauss_next)."""

    version: int
    internal: list[_U32] = Field(min_length=625, max_length=625)
    gauss_next: float | None


class RngState(_Strict):
    format: Literal[1] = 1
    torch: str = Field(description="base64 of torch.get_rng_state() (uint8)")
    cuda: list[str] = Field(default_factory=list, description="base64 of each CUDA device's state")
    numpy: NumpyState
    python: PythonState


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def capture() -> RngState:
    """This process's RNG states now."""
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    return RngState(
        torch=_b64(torch.get_rng_state()),
        cuda=[_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        numpy=NumpyState(keys=[int(k) for k in keys], pos=int(pos), has_gauss=int(has_gauss),
                         cached_gaussian=float(cached)),
        python=PythonState(version=version, internal=list(internal), gauss_next=gauss_next),
    )


def restore(state: RngState) -> None:
    torch.set_rng_state(_bytes_tensor(state.torch))
    n = state.numpy
    np.random.set_state((n.bit_generator, np.asarray(n.keys, dtype=np.uint32), n.pos, n.has_gauss,
                         n.cached_gaussian))
    random.setstate((state.python.version, tuple(state.python.internal), state.python.gauss_next))
    if state.cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in state.cuda])


def save(path: Path) -> None:
    path.write_text(capture().model_dump_json())


def load(path: Path) -> RngState:
    return RngState.model_validate_json(path.read_bytes())


def _legacy_safe_globals() -> list[Any]:
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_legacy(path: Path) -> RngState:
    """A pre-JSON ``rank_<r>.pt``, read without unpickling anything but tensors, numbers and numpy
    arrays; anything else is refused (``ValueError``)."""
    try:
        with torch.serialization.safe_globals(_legacy_safe_globals()):
            old = torch.load(path, weights_only=True)
        np_name, keys, pos, has_gauss, cached = old["numpy"]
        version, internal, gauss_next = old["python"]
        return RngState(
            torch=_b64(old["torch"]), cuda=[_b64(s) for s in old.get("cuda", [])],
            numpy=NumpyState(bit_generator=np_name, keys=[int(k) for k in keys], pos=int(pos),
                             has_gauss=int(has_gauss), cached_gaussian=float(cached)),
            python=PythonState(version=version, internal=list(internal), gauss_next=gauss_next),
        )
    except (pickle.UnpicklingError, EOFError, RuntimeError, KeyError, TypeError, ValueError):
        raise ValueError(
            f"{path}: not an RNG state this trainer reads: an old-format pickle is loaded only with "
            f"weights_only=True, and this one needs {_globals_named(path)}; refusing to unpickle it. "
            "Pass restore_rng=False to resume without the RNG states") from None


def _globals_named(path: Path) -> str:
    """The classes/functions a pickle would call (read from its opcodes, nothing executed)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not even a readable torch file
        return "more than tensors and numbers"
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _legacy_safe_globals()}
    return ", ".join(sorted(set(names) - allowed)[:5]) or "more than tensors and numbers"
