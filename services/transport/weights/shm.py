"""Colocated weight transport: two persistent shared-memory segments per replica, control over gRPC.

The CPU analogue of the CUDA-IPC weight sync of colocated RL systems: the rollout replica owns two
files in ``/dev/shm`` (``retool-weights-<random>-{0,1}``, mode 0600), each laid out like its weights
(every distinct weight once, at an aligned offset; tied names are aliases of one slot). A push is
``RegisterShm`` (which segment is free now) -> the trainer writes every weight into that segment
through its own mapping -> ``CommitShm`` -> the replica adopts the segment's tensors as its weights
(``engine.adopt_weights``, no copy). Each side copies nothing but the trainer's one write.

Invariants:
- a segment is *free* only while no weight the engine serves has its storage inside it (checked on
  the data pointers of the live weights, under the push lock); the replica reports and accepts
  only a free segment, so the trainer never writes served weights; after a commit the other
  segment is free again (double buffering);
- nothing is served from a segment before its commit: a client that dies mid-write changes nothing;
- segments are created lazily, fully allocated up front (``posix_fallocate``: a full ``/dev/shm``
  is an error at registration, never a SIGBUS mid-write), and unlinked when the weight server
  stops (and at interpreter exit); served weights stay valid after the unlink (the mapping lives);
- only for a trainer on the same machine, under the same uid, seeing the same ``/dev/shm``
  (same container or a shared IPC namespace/tmpfs). The sandbox never sees these files: its runs
  have their own mount namespace with a private tmpfs over ``/dev/shm`` and run under other uids.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import secrets
import shutil
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
import torch

from services.proto_gen import retool_pb2 as pb
from services.transport.weights.bucketing import DTYPES, dtype_name

SHM_DIR = Path("/dev/shm")
PREFIX = "retool-weights-"
ALIGN = 4096  # every tensor starts on a page (and cache line) boundary
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # map every page now, not on first touch


def boot_id() -> str:
    """This kernel's boot id (shared by every container on the machine); empty where unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class ShmError(ValueError):
    """A bad layout, a segment that cannot be used, or named tensors that do not fit the layout."""


@dataclass(frozen=True)
class Slot:
    """One distinct weight in a segment."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    aliases: tuple[str, ...] = ()


def plan_layout(weights: Mapping[str, torch.Tensor]) -> tuple[list[Slot], int]:
    """Slots for every distinct weight (first name wins, tied names become aliases) and the segment size."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, t in weights.items():
        key = id(t)
        if key in first:
            aliases[first[key]].append(name)
        else:
            first[key] = name
            aliases[name] = []
    slots, offset = [], 0
    for name in aliases:
        t = weights[name]
        dtype_name(t.dtype)  # a supported dtype, or a clear error naming it
        nbytes = t.numel() * t.element_size()
        slots.append(Slot(name, t.dtype, tuple(t.shape), offset, nbytes, tuple(aliases[name])))
        offset += -(-max(nbytes, 1) // ALIGN) * ALIGN
    if not slots:
        raise ShmError("weights: the engine has no weights to lay out")
    return slots, offset


def _views(buffer: mmap.mmap, slots: list[Slot]) -> dict[str, torch.Tensor]:
    base = torch.frombuffer(buffer, dtype=torch.uint8)
    return {s.name: base[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in slots}


def _map(path: Path, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)
        else:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise ShmError(f"{path}: owned by uid {st.st_uid}, not this process's uid {os.getuid()}")
            if st.st_size != size:
                raise ShmError(f"{path}: {st.st_size} bytes, the layout says {size}")
        return mmap.mmap(fd, size, flags=_MAP_FLAGS)
    finally:
        os.close(fd)


class ShmSegments:
    """Server side: the replica's two segments, laid out for ``weights`` (name -> live tensor)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], directory: str | Path = SHM_DIR) -> None:
        self.slots, self.segment_bytes = plan_layout(weights)
        self.layout_id = secrets.token_hex(8)
        directory = Path(directory)
        free = shutil.disk_usage(directory).free
        if free < 2 * self.segment_bytes:
            raise OSError(f"{directory}: {free} bytes free, two weight segments need "
                          f"{2 * self.segment_bytes}")
        self.paths = [directory / f"{PREFIX}{self.layout_id}-{i}" for i in (0, 1)]
        self._buffers: list[mmap.mmap] = []
        atexit.register(self.unlink)
        try:
            for path in self.paths:
                self._buffers.append(_map(path, self.segment_bytes, create=True))
        except BaseException:
            self.unlink()
            raise
        self._ranges = []
        for buf in self._buffers:
            start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
            self._ranges.append((start, start + self.segment_bytes))

    def tensors(self, segment: int) -> list[tuple[str, torch.Tensor]]:
        """Views of every distinct weight in ``segment`` (aliases are not repeated)."""
        return list(_views(self._buffers[segment], self.slots).items())

    def held(self, weights: Iterable[torch.Tensor]) -> list[bool]:
        """For each segment: does the storage of any of ``weights`` lie in it?"""
        held = [False, False]
        for t in weights:
            storage = t.untyped_storage()
            lo = storage.data_ptr()
            hi = lo + storage.nbytes()
            for i, (start, end) in enumerate(self._ranges):
                if lo < end and start < hi:
                    held[i] = True
        return held

    def free_segment(self, weights: Iterable[torch.Tensor]) -> int | None:
        """The segment that may be written now: one no served weight lies in (0 when both are)."""
        held = self.held(weights)
        return next((i for i in (0, 1) if not held[i]), None)

    def layout(self, free_segment: int, generation: int) -> pb.ShmLayout:
        return pb.ShmLayout(
            layout_id=self.layout_id, paths=[str(p) for p in self.paths], segment_bytes=self.segment_bytes,
            free_segment=free_segment, generation=generation,
            tensors=[pb.ShmTensor(name=s.name, dtype=dtype_name(s.dtype), shape=list(s.shape),
                                  offset=s.offset, nbytes=s.nbytes, aliases=list(s.aliases))
                     for s in self.slots])

    def unlink(self) -> None:
        """Remove the files (idempotent). Mapped memory, e.g. the served weights, stays valid."""
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        atexit.unregister(self.unlink)


def slots_from_layout(layout: pb.ShmLayout) -> list[Slot]:
    """Validate a ``ShmLayout`` (every field named in the error) and turn it into slots."""
    if len(layout.paths) != 2:
        raise ShmError(f"layout.paths: expected 2 segment files, got {len(layout.paths)}")
    slots = []
    for t in layout.tensors:
        if t.dtype not in DTYPES:
            raise ShmError(f"layout.tensors[{t.name}].dtype: {t.dtype!r} is not one of {sorted(DTYPES)}")
        dtype = DTYPES[t.dtype]
        shape = tuple(int(d) for d in t.shape)
        nbytes = prod(shape) * dtype.itemsize
        if nbytes != t.nbytes or t.offset + t.nbytes > layout.segment_bytes:
            raise ShmError(f"layout.tensors[{t.name}]: {t.nbytes} bytes at {t.offset} do not fit "
                           f"shape {shape} of {t.dtype} in a {layout.segment_bytes}-byte segment")
        slots.append(Slot(t.name, dtype, shape, int(t.offset), int(t.nbytes), tuple(t.aliases)))
    return slots


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (casting to the layout's dtype); a single-threaded memcpy when no cast is needed."""
    src = src.detach()
    if (src.device.type == "cpu" and src.dtype == dst.dtype and src.is_contiguous() and src.numel() > 0):
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


class ShmMapping:
    """Client side: a trainer's mapping of a replica's two segments (same host and uid only)."""

    def __init__(self, layout: pb.ShmLayout) -> None:
        self.layout_id = layout.layout_id
        self.slots = slots_from_layout(layout)
        self._canonical = {s.name: s.name for s in self.slots}
        self._canonical.update({a: s.name for s in self.slots for a in s.aliases})
        self._buffers: list[mmap.mmap] = []
        try:
            for path in layout.paths:
                try:
                    self._buffers.append(_map(Path(path), int(layout.segment_bytes), create=False))
                except FileNotFoundError:
                    raise ShmError(f"layout.paths: {path} does not exist here; the shared-memory transport "
                                   "needs the replica on this machine, under this uid, with the same "
                                   "/dev/shm") from None
        except BaseException:
            self.close()
            raise
        self._views = [_views(b, self.slots) for b in self._buffers]
        # one write at a time: a push cancelled mid-write leaves its copy thread running, and the
        # next push must not write (let alone commit) the segment before that thread is done
        self._write_lock = threading.Lock()

    def write(self, segment: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Copy every weight into ``segment``; returns (tensors, bytes). Raises before a commit if any
        weight of the layout is missing or a name/shape does not fit."""
        if segment not in (0, 1):
            raise ShmError(f"segment: must be 0 or 1, got {segment}")
        with self._write_lock:
            return self._write(segment, named_tensors)

    def _write(self, segment: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        if not self._views:
            raise ShmError("the mapping is closed")
        views, written, nbytes = self._views[segment], set(), 0
        with torch.no_grad():
            for name, src in named_tensors:
                canon = self._canonical.get(name)
                if canon is None:
                    raise ShmError(f"named_tensors: {name!r} is not a weight of the replica")
                if canon in written:  # the other name of a tied weight: the same tensor
                    continue
                dst = views[canon]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ShmError(f"named_tensors: {name} has shape {tuple(src.shape)}, "
                                   f"the replica's is {tuple(dst.shape)}")
                _copy(dst, src)
                written.add(canon)
                nbytes += dst.numel() * dst.element_size()
        missing = [s.name for s in self.slots if s.name not in written]
        if missing:
            raise ShmError(f"named_tensors: {len(missing)} weights missing, e.g. {missing[:3]}")
        return len(written), nbytes

    def close(self) -> None:
        self._views = []
        for buf in self._buffers:
            with contextlib.suppress(BufferError):  # views still alive elsewhere: the GC unmaps it later
                buf.close()
        self._buffers = []
