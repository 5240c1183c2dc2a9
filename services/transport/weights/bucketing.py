"""Tensors <-> bucketed ``WeightChunk`` messages (the wire format of a weight push).

Packing flattens each tensor's payload (its raw bytes, or for a delta push possibly a SPARSE
encoding, see ``delta.py``) into messages of ``bucket_bytes`` (the last one may be smaller); a
payload larger than the room left in a bucket is split into byte segments across consecutive
messages, in order. Staging reassembles them into one CPU buffer per tensor (FULL) or per payload.

Invariants:
- a ``Stager`` never exposes a tensor until the whole push is complete (``last`` seen, every
  declared tensor has all its bytes, totals match);
- segments of a tensor arrive in byte order with no gaps or overlaps, and every segment's
  metadata (dtype, shape, size, encoding) agrees with the tensor's first segment, and every
  message's push fields (version, delta, base version, lineage) with the first message's;
  anything else is a ``PushError`` naming the tensor or the field; SPARSE only in a delta push;
- tensors are copied exactly once on each side (into the message on the client, into the
  staging buffer on the server); staging buffers come from a ``StagingPool`` that is reused
  from push to push (touching fresh pages costs far more than copying into warm ones), so the
  tensors a ``Stager`` hands out are only valid until the next push starts — unless the engine
  adopts them as its weights (``StagingPool.handoff``): then the pool never writes them again
  and takes the engine's replaced buffers in exchange (double buffering, no copy into the engine).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from math import prod

import numpy as np
import torch

from services.proto_gen import retool_pb2 as pb

# 2 MiB: a message then still fits in the caches it is copied through (join, gRPC, kernel, staging);
# bench/weights.py on 2 cores measured 1.93 GB/s at 2 MiB vs 1.38 GB/s at 4 MiB (bench preset)
DEFAULT_BUCKET_BYTES = 2 << 20
MIN_BUCKET_BYTES = 1 << 10
MAX_BUCKET_BYTES = 32 << 20
# message size limit on both ends: one bucket plus the segment metadata
MAX_MESSAGE_BYTES = MAX_BUCKET_BYTES + (4 << 20)
# channel/server options on both ends (gRPC's default message limit is 4 MiB)
GRPC_BULK_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                 "bool")
}


class PushError(ValueError):
    """A malformed or incomplete push; the message names the tensor or the field."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise PushError(f"dtype {name} is not supported (one of {sorted(DTYPES)})")
    return name


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass
class WireTensor:
    """One tensor as it travels: its metadata and its payload (raw bytes or an encoding of them)."""

    name: str
    dtype: str                # torch dtype name without "torch."
    shape: tuple[int, ...]
    nbytes: int               # bytes of the whole tensor
    payload: memoryview       # FULL: the tensor's bytes; SPARSE: indices + values (delta.py)
    encoding: int = pb.FULL
    changed: int = 0          # SPARSE: elements carried; FULL: every element

    @property
    def payload_bytes(self) -> int:
        return len(self.payload)

    @classmethod
    def full(cls, name: str, tensor: torch.Tensor) -> WireTensor:
        data = _as_bytes(tensor)
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape), len(data), data, pb.FULL,
                   tensor.numel())


@dataclass
class Bucket:
    """One message's worth of tensor bytes: ``header`` (a ``WeightChunk`` without ``data``) + parts."""

    header: pb.WeightChunk
    parts: list[memoryview]

    def to_message(self) -> pb.WeightChunk:
        msg = pb.WeightChunk()
        msg.CopyFrom(self.header)
        msg.data = b"".join(self.parts)
        return msg

    def encode(self) -> bytes:
        """The serialized ``WeightChunk``, with the tensor bytes copied exactly once."""
        size = sum(len(p) for p in self.parts)
        return b"".join([self.header.SerializeToString(), _DATA_TAG, _varint(size), *self.parts])


_DATA_TAG = bytes([(3 << 3) | 2])  # WeightChunk.data: field 3, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise PushError("malformed WeightChunk: bad varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def decode_chunk(raw: bytes) -> tuple[pb.WeightChunk, memoryview]:
    """Parse a serialized ``WeightChunk`` without copying ``data`` (a view into ``raw``).

    Accepts any valid encoding (fields in any order), e.g. from a generated protobuf client.
    """
    buf = memoryview(raw)
    header: list[memoryview] = []
    data = memoryview(b"")
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            if key >> 3 == 3:
                if pos + length > len(buf):
                    raise PushError("malformed WeightChunk: data runs past the message")
                data = buf[pos:pos + length]
                pos += length
                continue
            pos += length
        else:
            raise PushError(f"malformed WeightChunk: wire type {wire}")
        if pos > len(buf):
            raise PushError("malformed WeightChunk: truncated field")
        header.append(buf[start:pos])
    return pb.WeightChunk.FromString(b"".join(header)), data


@dataclass(frozen=True)
class PushKind:
    """The push-level fields of every message: a full push (default) or a delta on ``base_version``."""

    delta: bool = False
    base_version: int = 0
    lineage: str = ""


def iter_buckets(tensors: Iterable[tuple[str, torch.Tensor] | WireTensor], version: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, kind: PushKind = PushKind()) -> Iterator[Bucket]:
    """Pack tensors (or ready ``WireTensor``s) into buckets of ``bucket_bytes`` (the last may be smaller)."""
    if not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise PushError(f"bucket_bytes: {bucket_bytes} is outside [{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}]")

    def chunk(**fields: object) -> pb.WeightChunk:
        return pb.WeightChunk(version=version, delta=kind.delta, base_version=kind.base_version,
                              lineage=kind.lineage, **fields)  # type: ignore[arg-type]

    parts: list[memoryview] = []
    segments: list[pb.TensorSegment] = []
    used = 0
    n_tensors = total = 0
    seen: set[str] = set()
    for item in tensors:
        wire = item if isinstance(item, WireTensor) else WireTensor.full(*item)
        if wire.name in seen:
            raise PushError(f"tensor {wire.name!r} appears twice in the push")
        if wire.encoding != pb.FULL and not kind.delta:
            raise PushError(f"tensor {wire.name!r}: only a delta push may carry encoded tensors")
        seen.add(wire.name)
        data, size = wire.payload, wire.payload_bytes
        encoded = wire.encoding != pb.FULL
        meta = {"name": wire.name, "dtype": wire.dtype, "shape": list(wire.shape), "total_bytes": wire.nbytes}
        if encoded:
            meta.update(encoding=wire.encoding, payload_bytes=size, changed=wire.changed)
        n_tensors += 1
        total += size
        offset = 0
        while True:
            n = min(bucket_bytes - used, size - offset)
            segments.append(pb.TensorSegment(offset=offset, length=n, data_offset=used, **meta))  # type: ignore[arg-type]
            parts.append(data[offset:offset + n])
            used += n
            offset += n
            if used >= bucket_bytes:
                yield Bucket(chunk(segments=segments), parts)
                parts, segments, used = [], [], 0
            if offset >= size:
                break
    yield Bucket(chunk(segments=segments, last=True, total_tensors=n_tensors, total_bytes=total), parts)


def iter_chunks(tensors: Iterable[tuple[str, torch.Tensor] | WireTensor], version: int,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                kind: PushKind = PushKind()) -> Iterator[pb.WeightChunk]:
    """The same buckets as complete protobuf messages (for generated-stub clients and tests)."""
    for bucket in iter_buckets(tensors, version, bucket_bytes, kind):
        yield bucket.to_message()


class StagingPool:
    """Per-tensor staging buffers kept between pushes (one push at a time may use a pool)."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        self._lent: set[int] = set()  # addresses of pool buffers an engine adopted as its weights
        self._payloads: dict[str, np.ndarray] = {}  # encoded payloads of delta pushes (never lent)

    def get(self, name: str, nbytes: int) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes != nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            self._buffers[name] = buf
        return buf

    def payload(self, name: str, nbytes: int) -> np.ndarray:
        """A buffer for an encoded payload of ``nbytes`` (grown, never shrunk: sizes vary per push)."""
        buf = self._payloads.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 2 * buf.nbytes if buf is not None else 0), dtype=np.uint8)
            self._payloads[name] = buf
        return buf[:nbytes]

    def handoff(self, name: str, adopted: torch.Tensor, replaced: torch.Tensor) -> None:
        """The engine now serves ``adopted`` as ``name`` and gave back ``replaced``.

        If ``adopted`` is this pool's buffer, the pool stops using it (a later push must never write
        the live weights); ``replaced`` becomes the buffer of ``name`` only if it is a buffer this
        pool lent out earlier (the engine's original weights, e.g. mmapped files, are never reused).
        """
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes == 0 or adopted.data_ptr() != buf.ctypes.data:
            return  # the engine adopted a copy (e.g. bool), the pool buffer stays free
        self._lent.add(buf.ctypes.data)
        del self._buffers[name]
        ptr = replaced.data_ptr()
        if ptr in self._lent and replaced.is_contiguous() and replaced.nbytes == buf.nbytes:
            self._lent.discard(ptr)
            self._buffers[name] = replaced.detach().reshape(-1).view(torch.uint8).numpy()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


@dataclass
class _Staged:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int               # of the tensor
    buffer: np.ndarray        # FULL: the tensor's bytes; encoded: the payload
    encoding: int = pb.FULL
    changed: int = 0
    received: int = 0


@dataclass
class EncodedTensor:
    """A complete encoded payload of a delta push (decoded by ``delta.decode_sparse``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: int
    changed: int
    payload: np.ndarray


class Stager:
    """Server side: reassemble one push; ``tensors()``/``encoded()`` only once it is complete."""

    def __init__(self, expected: dict[str, tuple[int, ...]] | None = None,
                 max_bytes: int | None = None, pool: StagingPool | None = None) -> None:
        self.expected = expected  # name -> shape, when the engine can tell (rejects early)
        self.max_bytes = max_bytes
        self.pool = pool
        self.version: int | None = None
        self.kind: PushKind | None = None
        self.bytes = 0
        self.last = False
        self._staged: dict[str, _Staged] = {}

    @property
    def delta(self) -> bool:
        return self.kind is not None and self.kind.delta

    def add(self, chunk: pb.WeightChunk, data: bytes | memoryview | None = None) -> None:
        """Stage one message; ``data`` overrides ``chunk.data`` (see ``decode_chunk``)."""
        if self.last:
            raise PushError("message after the one marked last")
        kind = PushKind(chunk.delta, chunk.base_version, chunk.lineage)
        if self.version is None:
            self.version, self.kind = chunk.version, kind
        elif chunk.version != self.version:
            raise PushError(f"version changed inside a push ({self.version} -> {chunk.version})")
        elif kind != self.kind:
            raise PushError("delta/base_version/lineage changed inside a push")
        if data is None:
            data = chunk.data
        for seg in chunk.segments:
            st = self._staged.get(seg.name) or self._start(seg)
            if (seg.dtype, tuple(seg.shape), seg.total_bytes, seg.encoding, seg.changed) != (
                    st.dtype, st.shape, st.nbytes, st.encoding, st.changed) or (
                    seg.encoding != pb.FULL and seg.payload_bytes != st.buffer.nbytes):
                raise PushError(f"tensor {seg.name!r}: segment metadata disagrees with its first segment")
            if seg.offset != st.received:
                raise PushError(f"tensor {seg.name!r}: segment at byte {seg.offset}, expected {st.received}")
            end = seg.data_offset + seg.length
            if end > len(data) or seg.offset + seg.length > st.buffer.nbytes:
                raise PushError(f"tensor {seg.name!r}: segment runs past the message or the tensor")
            if seg.length:
                st.buffer[seg.offset:seg.offset + seg.length] = np.frombuffer(
                    data, dtype=np.uint8, count=seg.length, offset=seg.data_offset)
            st.received += seg.length
        self.bytes += len(data)
        if chunk.last:
            self.last = True
            self._check_complete(chunk)

    def _start(self, seg: pb.TensorSegment) -> _Staged:
        if seg.dtype not in DTYPES:
            raise PushError(f"tensor {seg.name!r}: dtype {seg.dtype!r} is not supported")
        shape = tuple(int(d) for d in seg.shape)
        itemsize = torch.empty((), dtype=DTYPES[seg.dtype]).element_size()
        if any(d < 0 for d in shape) or prod(shape) * itemsize != seg.total_bytes:
            raise PushError(
                f"tensor {seg.name!r}: shape {list(shape)} x {seg.dtype} != {seg.total_bytes} bytes")
        if seg.encoding not in (pb.FULL, pb.SPARSE):
            raise PushError(f"tensor {seg.name!r}: unknown encoding {seg.encoding}")
        if seg.encoding != pb.FULL and not self.delta:
            raise PushError(f"tensor {seg.name!r}: encoding SPARSE is only valid in a delta push")
        if self.expected is not None:
            want = self.expected.get(seg.name)
            if want is None:
                raise PushError(f"tensor {seg.name!r} is not a weight of the served model")
            if tuple(want) != shape:
                raise PushError(f"tensor {seg.name!r}: shape {list(shape)}, the model has {list(want)}")
        size = seg.total_bytes if seg.encoding == pb.FULL else seg.payload_bytes
        staged_total = sum(s.buffer.nbytes for s in self._staged.values()) + size
        if self.max_bytes is not None and staged_total > self.max_bytes:
            raise PushError(f"push exceeds max_bytes={self.max_bytes}")
        if seg.encoding == pb.FULL:
            buffer = (self.pool.get(seg.name, size) if self.pool is not None
                      else np.empty(size, dtype=np.uint8))
        else:
            buffer = (self.pool.payload(seg.name, size) if self.pool is not None
                      else np.empty(size, dtype=np.uint8))
        st = _Staged(seg.dtype, shape, seg.total_bytes, buffer, seg.encoding, seg.changed)
        self._staged[seg.name] = st
        return st

    def _check_complete(self, last: pb.WeightChunk) -> None:
        if last.total_tensors != len(self._staged):
            raise PushError(f"incomplete push: {len(self._staged)} of {last.total_tensors} tensors arrived")
        if last.total_bytes != self.bytes:
            raise PushError(f"incomplete push: {self.bytes} of {last.total_bytes} bytes arrived")
        short = [n for n, s in self._staged.items() if s.received != s.buffer.nbytes]
        if short:
            raise PushError(f"incomplete push: tensors missing bytes: {short[:5]}")

    @property
    def complete(self) -> bool:
        return self.last

    def names(self) -> list[str]:
        return list(self._staged)

    def dtypes(self) -> dict[str, str]:
        return {name: st.dtype for name, st in self._staged.items()}

    def changed(self) -> int:
        """Elements a delta push changes (every element of its FULL tensors)."""
        return sum(st.changed if st.encoding != pb.FULL else st.nbytes // DTYPES[st.dtype].itemsize
                   for st in self._staged.values())

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The FULL tensors of the push."""
        if not self.last:
            raise PushError("incomplete push: the message marked last never arrived")
        out = []
        for name, st in self._staged.items():
            if st.encoding != pb.FULL:
                continue
            dtype = DTYPES[st.dtype]
            if st.buffer.nbytes == 0:
                out.append((name, torch.empty(st.shape, dtype=dtype)))
                continue
            raw = torch.from_numpy(st.buffer)
            t = raw.to(torch.bool) if dtype == torch.bool else raw.view(dtype)
            out.append((name, t.reshape(st.shape)))
        return out

    def encoded(self) -> list[EncodedTensor]:
        """The encoded (non-FULL) tensors of a delta push."""
        if not self.last:
            raise PushError("incomplete push: the message marked last never arrived")
        return [EncodedTensor(name, DTYPES[st.dtype], st.shape, st.encoding, st.changed, st.buffer)
                for name, st in self._staged.items() if st.encoding != pb.FULL]
