"""What a weight push must look like for the served model, checked before anything reaches an engine.

A ``WeightSpec`` lists every weight of the served model under its Hugging Face name (the names the
trainer and ``retool rollout push-weights`` send), with its shape and the dtype it is served in, and
the tied aliases (``lm_head.weight`` -> ``model.embed_tokens.weight`` when the embeddings are tied).

Invariants of ``WeightSpec.check`` (the only way a push reaches ``VLLMEngine``):
- every name is a weight of the served model (or a tied alias of one), given once;
- every shape equals the served one exactly;
- dtypes: a floating-point weight takes any floating-point tensor (it is cast to the served dtype,
  as a checkpoint load would: a float32 trainer may push into a bfloat16 replica; at equal dtypes
  the swap is bit-exact); integer / bool tensors for floating weights (and the reverse) are refused;
- a push covers every weight (``complete=True``): a partial push would leave the replica serving a
  mix of two policies under one version;
- a tied alias given alongside its target must hold the same values; only the target is loaded;
- on any violation a ``WeightPushRejected`` (a ``ValueError``) names the tensor and nothing is
  returned, so the caller has not touched the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch


class WeightPushRejected(ValueError):
    """A push that does not fit the served model; the message names the tensor and the rule."""


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class WeightSpec:
    tensors: dict[str, TensorSpec]
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name that is loaded

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: torch.dtype | None = None) -> WeightSpec:
        """The weights of a Hugging Face model directory, read from its safetensors headers (no tensor
        data is read). ``dtype``: the dtype the model is served in (floating weights only)."""
        root = Path(model_dir)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{root}: no *.safetensors files (the vLLM engine serves safetensors)")
        tensors: dict[str, TensorSpec] = {}
        for path in files:
            for name, meta in _safetensors_header(path).items():
                if name == "__metadata__":
                    continue
                stored = _SAFETENSORS_DTYPES.get(meta["dtype"])
                if stored is None:
                    raise ValueError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
                served = dtype if dtype is not None and stored.is_floating_point else stored
                tensors[name] = TensorSpec(tuple(int(d) for d in meta["shape"]), served)
        aliases: dict[str, str] = {}
        config = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
        if config.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
            embed = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
            if embed is not None:
                aliases["lm_head.weight"] = embed
        return cls(tensors, aliases)

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> WeightSpec:
        """The state dict of a torch module; a second name of a shared tensor is a tied alias."""
        tensors: dict[str, TensorSpec] = {}
        aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in first:
                aliases[name] = first[id(t)]
                continue
            first[id(t)] = name
            tensors[name] = TensorSpec(tuple(t.shape), t.dtype)
        return cls(tensors, aliases)

    # ------------------------------------------------------------------ queries
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every accepted name (aliases included) with its shape."""
        out = {name: spec.shape for name, spec in self.tensors.items()}
        out.update({alias: self.tensors[target].shape for alias, target in self.aliases.items()})
        return out

    def missing(self, names: Iterable[str]) -> list[str]:
        """Weights that ``names`` leaves unset (an alias counts for its target)."""
        given = {self.aliases.get(n, n) for n in names}
        return [n for n in self.tensors if n not in given]

    # ------------------------------------------------------------------ the check
    def check(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
              complete: bool = True) -> list[tuple[str, torch.Tensor]]:
        """The push as ``(name, tensor)`` pairs to load (aliases resolved away), or ``WeightPushRejected``."""
        out: dict[str, torch.Tensor] = {}
        alias_values: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            target = self.aliases.get(name, name)
            spec = self.tensors.get(target)
            if spec is None:
                raise WeightPushRejected(f"tensor {name!r} is not a weight of the served model")
            if name in out or name in alias_values:
                raise WeightPushRejected(f"tensor {name!r} is given twice")
            if tuple(tensor.shape) != spec.shape:
                raise WeightPushRejected(
                    f"tensor {name!r}: shape {list(tensor.shape)}, the served model has {list(spec.shape)}")
            if tensor.dtype.is_floating_point != spec.dtype.is_floating_point or (
                    not spec.dtype.is_floating_point and tensor.dtype != spec.dtype):
                raise WeightPushRejected(
                    f"tensor {name!r}: dtype {_name(tensor.dtype)} cannot be loaded into the served "
                    f"{_name(spec.dtype)} weight")
            if name == target:
                out[name] = tensor
            else:
                alias_values[name] = tensor
        for alias, tensor in alias_values.items():
            target = self.aliases[alias]
            if target not in out:
                out[target] = tensor  # the tied weight given under its other name only
            elif not _same_values(out[target], tensor):
                raise WeightPushRejected(
                    f"tensor {alias!r} is tied to {target!r} in the served model, but the push gives them "
                    "different values")
        if complete:
            missing = self.missing(out)
            if missing:
                raise WeightPushRejected(
                    f"incomplete push: {len(missing)} weights of the served model missing, "
                    f"e.g. {missing[:3]}")
        return list(out.items())


def validate_push(engine: object, named_tensors: list[tuple[str, torch.Tensor]], *,
                  complete: bool = True) -> None:
    """Check a push against ``engine.weight_spec()`` when the engine has one (raises
    ``WeightPushRejected``); used by the weight server before the engine is called. A delta push
    (``complete=False``) carries only the tensors it replaces whole; its patches are checked apart."""
    spec_fn = getattr(engine, "weight_spec", None)
    if callable(spec_fn):
        spec = spec_fn()
        if isinstance(spec, WeightSpec):
            spec.check(named_tensors, complete=complete)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b.to(a.dtype)))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _safetensors_header(path: Path) -> dict[str, dict]:
    """The JSON header of a safetensors file: name -> {dtype, shape, data_offsets}."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header size {size})")
        return json.loads(f.read(size))
