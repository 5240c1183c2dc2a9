"""Delta weight pushes: the elements that changed in the serving dtype, found, encoded and applied.

Trainer side, ``DeltaEncoder``: keeps the *shadow*, the weights exactly as the replicas of its
lineage hold them (the last version it encoded, in the serving dtype). ``update`` casts the new
master weights to the serving dtype chunk by chunk, compares the bit patterns with the shadow,
writes the changed elements into the shadow and returns them as ``WireTensor``s: ``SPARSE``
(uint32 indices + new values) or, when that is not smaller than half the tensor, ``FULL``.
Replica side, ``decode_sparse`` + ``SparsePatch``: validate a SPARSE payload against the served
tensor, then write the new values into it.

Invariants:
- changes are found on bit patterns (integer views), so ``-0.0`` vs ``0.0`` and NaN payloads count:
  applying every delta of a chain to the weights of a full push gives, bit for bit, the cast of the
  latest master weights, i.e. what a full push of that version carries (``full()``);
- the shadow changes only inside ``update``; after it, ``full()`` is the new version's weights;
- ``where="device"``: a second shadow lives on the master weights' device (the GPU next to them)
  and the compare runs there with torch; only the changed elements (indices + values) cross to the
  host, where the host shadow (what full pushes send) is patched. Both paths give the same shadow
  bits and decode to the same weights (tests/unit/test_weights_delta.py); which is faster on a GPU
  is measured by ``bench.gpu`` (weights section) before a default changes: today "host";
- a SPARSE payload is accepted only if its size matches ``changed``, its indices are strictly
  ascending and inside the tensor, and its dtype is the served tensor's; ``SparsePatch.validate``
  runs for every patch of a push before any ``apply`` touches a served weight.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from services.proto_gen import retool_pb2 as pb
from services.transport.weights.bucketing import PushError, WireTensor, dtype_name

INDEX_BYTES = 4  # uint32 element indices: a tensor of up to 2**32 elements
MAX_SPARSE_ELEMENTS = 1 << 32
# a tensor goes FULL when its SPARSE payload would be at least this fraction of its raw bytes
# (applying a sparse element costs more than copying one, and the bytes saved are few)
SPARSE_MAX_FRACTION = 0.5
CHUNK_ELEMENTS = 1 << 20  # per task: the cast and the mask of a chunk stay in the caches
_INT_VIEWS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
              8: (torch.int64, np.int64)}


def int_view(t: torch.Tensor) -> np.ndarray:
    """The flat bit patterns of a contiguous CPU tensor as a numpy integer array (shares memory)."""
    tdt, _ = _INT_VIEWS[t.element_size()]
    return t.detach().reshape(-1).view(tdt).numpy()


def new_lineage() -> str:
    return secrets.token_hex(8)


@dataclass
class EncodedDelta:
    """One version's changes against ``base_version`` (only the tensors that changed)."""

    base_version: int
    version: int
    tensors: list[WireTensor]
    elements: int           # every element of every weight
    changed: int            # elements that changed (all elements of FULL tensors count)
    full_bytes: int         # bytes of a full push in the serving dtype
    seconds: float          # cast + compare + encode

    @property
    def payload_bytes(self) -> int:
        return sum(t.payload_bytes for t in self.tensors)

    @property
    def density(self) -> float:
        """Fraction of the elements that changed in the serving dtype."""
        return self.changed / self.elements if self.elements else 0.0


@dataclass
class _Scratch:
    cast: torch.Tensor
    mask: np.ndarray


@dataclass
class _Chunk:
    count: int
    dense: bool
    indices: np.ndarray | None = None
    values: np.ndarray | None = None


@dataclass
class DeltaEncoder:
    """The trainer's shadow of what the replicas of ``lineage`` serve, and the deltas against it."""

    dtype: torch.dtype
    threads: int = 2
    where: Literal["host", "device"] = "host"  # where the compare runs (see the module docstring)
    lineage: str = field(default_factory=new_lineage)
    version: int | None = None  # version the shadow holds; None = nothing encoded yet
    _shadow: dict[str, torch.Tensor] = field(default_factory=dict)
    _device_shadow: dict[str, torch.Tensor] = field(default_factory=dict)  # where="device" only
    _local: threading.local = field(default_factory=threading.local)
    _pool: ThreadPoolExecutor | None = None

    def full(self) -> list[tuple[str, torch.Tensor]]:
        """The weights of ``version`` in the serving dtype (what a full push sends)."""
        return list(self._shadow.items())

    def update(self, named: Iterable[tuple[str, torch.Tensor]], version: int,
               compare: bool = True) -> EncodedDelta | None:
        """Make the shadow hold ``named`` (cast to ``dtype``) as ``version``; the changes against the
        previous version, or None when there was none (or the names/shapes differ, or not
        ``compare``: a full push follows)."""
        start = time.perf_counter()
        items = [(name, t.detach().contiguous()) for name, t in named]
        same = self.version is not None and [n for n, _ in items] == list(self._shadow) and all(
            tuple(t.shape) == tuple(self._shadow[n].shape) for n, t in items)
        if not same:
            self._shadow = {n: t.to(device="cpu", dtype=self.dtype, copy=True).contiguous() for n, t in items}
            self._device_shadow = ({n: t.to(dtype=self.dtype, copy=True).contiguous() for n, t in items}
                                   if self.where == "device" else {})
        elif not compare:
            for n, t in items:
                self._shadow[n].copy_(t)
                if n in self._device_shadow:
                    self._device_shadow[n].copy_(t)
        if not same or not compare:
            self.version = version
            return None
        assert self.version is not None
        base, self.version = self.version, version
        if self._device_shadow:
            return self._finish(base, version, items, {n: [self._on_device(n, t)] for n, t in items}, start)
        tasks = [(name, master, lo, min(lo + CHUNK_ELEMENTS, master.numel()))
                 for name, master in items for lo in range(0, master.numel(), CHUNK_ELEMENTS)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.threads), thread_name_prefix="delta-encode",
                                            initializer=torch.set_num_threads, initargs=(1,))
        chunks = list(self._pool.map(lambda task: self._chunk(*task), tasks))
        by_name: dict[str, list[_Chunk]] = {}
        for (name, *_), chunk in zip(tasks, chunks, strict=True):
            by_name.setdefault(name, []).append(chunk)
        return self._finish(base, version, items, by_name, start)

    def _finish(self, base: int, version: int, items: list[tuple[str, torch.Tensor]],
                by_name: dict[str, list[_Chunk]], start: float) -> EncodedDelta:
        tensors, elements, changed, full_bytes = [], 0, 0, 0
        for name, _ in items:
            shadow = self._shadow[name]
            elements += shadow.numel()
            full_bytes += shadow.numel() * shadow.element_size()
            wire = self._wire(name, shadow, by_name.get(name, []))
            if wire is not None:
                tensors.append(wire)
                changed += wire.changed
        seconds = time.perf_counter() - start
        return EncodedDelta(base, version, tensors, elements, changed, full_bytes, seconds)

    def _scratch(self) -> _Scratch:
        s = getattr(self._local, "scratch", None)
        if s is None or s.cast.dtype != self.dtype:
            s = _Scratch(torch.empty(CHUNK_ELEMENTS, dtype=self.dtype), np.empty(CHUNK_ELEMENTS, dtype=bool))
            self._local.scratch = s
        return s

    def _chunk(self, name: str, master: torch.Tensor, lo: int, hi: int) -> _Chunk:
        """Cast elements [lo, hi) of ``master``, compare them with the shadow and update it."""
        s = self._scratch()
        n = hi - lo
        cast = s.cast[:n]
        cast.copy_(master.reshape(-1)[lo:hi])
        new, old = int_view(cast), int_view(self._shadow[name])[lo:hi]
        mask = s.mask[:n]
        np.not_equal(new, old, out=mask)
        idx = np.flatnonzero(mask)  # one pass (no count first): changes are sparse at RL learning rates
        count = len(idx)
        if count == 0:
            return _Chunk(0, False)
        if count * (INDEX_BYTES + cast.element_size()) >= SPARSE_MAX_FRACTION * n * cast.element_size():
            old[:] = new
            return _Chunk(count, True)
        values = new[idx]
        old[idx] = values
        index = idx.astype(np.uint32)
        index += lo
        return _Chunk(count, False, index, values)

    def _on_device(self, name: str, master: torch.Tensor) -> _Chunk:
        """The compare of one tensor where its shadow lives (torch); patches the host shadow too."""
        old = self._device_shadow[name].reshape(-1)
        new = master.reshape(-1).to(self.dtype)
        tdt, _ = _INT_VIEWS[old.element_size()]
        ob, nb = old.view(tdt), new.view(tdt)
        idx = (nb != ob).nonzero().reshape(-1)  # the one host sync of the tensor
        count = idx.numel()
        if count == 0:
            return _Chunk(0, False)
        host, item = int_view(self._shadow[name]), old.element_size()
        if count * (INDEX_BYTES + item) >= SPARSE_MAX_FRACTION * old.numel() * item:
            ob.copy_(nb)
            host[:] = nb.cpu().numpy()
            return _Chunk(count, True)
        values = nb[idx]
        ob[idx] = values
        index = idx.to(torch.int32 if old.numel() < 2**31 else torch.int64).cpu().numpy().astype(np.uint32)
        values_h = values.cpu().numpy()
        host[index] = values_h
        return _Chunk(count, False, index, values_h)

    @staticmethod
    def _wire(name: str, shadow: torch.Tensor, chunks: list[_Chunk]) -> WireTensor | None:
        count = sum(c.count for c in chunks)
        if count == 0:
            return None
        item = shadow.element_size()
        nbytes = shadow.numel() * item
        sparse = count * (INDEX_BYTES + item)
        dtype, shape = dtype_name(shadow.dtype), tuple(shadow.shape)
        if (any(c.dense for c in chunks) or sparse >= SPARSE_MAX_FRACTION * nbytes
                or shadow.numel() > MAX_SPARSE_ELEMENTS):
            return WireTensor(name, dtype, shape, nbytes, memoryview(int_view(shadow)).cast("B"),
                              changed=shadow.numel())
        payload = np.empty(sparse, dtype=np.uint8)
        idx = payload[:count * INDEX_BYTES].view(np.uint32)
        values = payload[count * INDEX_BYTES:].view(_INT_VIEWS[item][1])
        at = 0
        for c in chunks:
            if c.count:
                assert c.indices is not None and c.values is not None
                idx[at:at + c.count] = c.indices
                values[at:at + c.count] = c.values
                at += c.count
        return WireTensor(name, dtype, shape, nbytes, memoryview(payload), encoding=pb.SPARSE, changed=count)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass
class SparsePatch:
    """New values for some elements of one served tensor (a decoded SPARSE payload)."""

    name: str
    dtype: torch.dtype
    indices: np.ndarray  # uint32, strictly ascending
    values: np.ndarray   # the new bit patterns (integer view of ``dtype``)

    def validate(self, target: torch.Tensor) -> None:
        """Raise ValueError unless ``apply`` can write every value into ``target``."""
        if target.dtype != self.dtype:
            raise ValueError(f"{self.name}: a delta in {dtype_name(self.dtype)}, but the replica serves "
                             f"{str(target.dtype).removeprefix('torch.')}")
        if len(self.indices) and int(self.indices[-1]) >= target.numel():
            raise ValueError(f"{self.name}: element index {int(self.indices[-1])} is outside the tensor "
                             f"({target.numel()} elements)")
        if target.device.type != "cpu":
            raise ValueError(f"{self.name}: deltas apply to CPU weights only (it is on {target.device})")

    def apply(self, target: torch.Tensor) -> None:
        """``target.flatten()[indices] = values`` in place, on the bit patterns."""
        if not len(self.indices):
            return
        if target.is_contiguous():
            int_view(target)[self.indices] = self.values
            return
        tdt, _ = _INT_VIEWS[target.element_size()]
        target.view(tdt).put_(torch.from_numpy(self.indices.astype(np.int64)), torch.from_numpy(self.values))


def decode_sparse(name: str, dtype: torch.dtype, numel: int, changed: int,
                  payload: np.ndarray) -> SparsePatch:
    """A SPARSE payload (uint8 array) as a ``SparsePatch``; ``PushError`` naming the tensor if malformed."""
    item = torch.empty((), dtype=dtype).element_size()
    if item not in _INT_VIEWS:
        raise PushError(f"tensor {name!r}: SPARSE is not supported for {dtype}")
    if changed > numel:
        raise PushError(f"tensor {name!r}: {changed} changed elements of {numel}")
    if payload.nbytes != changed * (INDEX_BYTES + item):
        raise PushError(f"tensor {name!r}: SPARSE payload of {payload.nbytes} bytes, expected "
                        f"{changed} x ({INDEX_BYTES} + {item})")
    idx = payload[:changed * INDEX_BYTES].view("<u4")
    values = payload[changed * INDEX_BYTES:].view(_INT_VIEWS[item][1])
    if changed:
        if int(idx[-1]) >= numel:
            raise PushError(f"tensor {name!r}: element index {int(idx[-1])} is outside the tensor ({numel})")
        if changed > 1 and not bool(np.all(idx[1:] > idx[:-1])):
            raise PushError(f"tensor {name!r}: SPARSE indices are not strictly ascending")
    return SparsePatch(name, dtype, idx, values)
