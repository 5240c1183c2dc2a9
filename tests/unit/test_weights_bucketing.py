"""The weight-push wire format: packing into buckets and staging back, with its refusals."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from services.proto_gen import retool_pb2 as pb
from services.transport.weights.bucketing import (
    PushError,
    Stager,
    StagingPool,
    decode_chunk,
    iter_buckets,
    iter_chunks,
)

KIB = 1 << 10


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(300, 70, generator=g),  # 84 000 bytes: split over several buckets
        "half": torch.randn(17, 3, generator=g).bfloat16(),
        "fp16": torch.randn(5, generator=g).half(),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(10),
        "flags": torch.tensor([True, False, True]),
        "strided": torch.randn(8, 6, generator=g).t(),  # non-contiguous source
    }


def _stage(chunks, expected=None) -> Stager:
    st = Stager(expected)
    for c in chunks:
        st.add(c)
    return st


@pytest.mark.parametrize("bucket", [KIB, 4 * KIB, 64 * KIB, 4 * KIB * KIB])
def test_round_trip_is_exact_for_every_dtype_and_bucket_size(bucket):
    sd = _state()
    chunks = list(iter_chunks(sd.items(), version=9, bucket_bytes=bucket))
    assert all(len(c.data) == bucket for c in chunks[:-1])  # full buckets except the last
    assert len(chunks[-1].data) <= bucket and chunks[-1].last and not any(c.last for c in chunks[:-1])
    st = _stage(chunks)
    out = dict(st.tensors())
    assert st.version == 9 and list(out) == list(sd)
    for name, t in sd.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name
    assert st.bytes == chunks[-1].total_bytes == sum(t.numel() * t.element_size() for t in sd.values())


def test_large_tensor_is_split_into_ordered_segments():
    chunks = list(iter_chunks([("w", torch.ones(1000))], version=1, bucket_bytes=KIB))
    segs = [s for c in chunks for s in c.segments]
    assert len(chunks) == 4 and [s.offset for s in segs] == [0, 1024, 2048, 3072]
    assert sum(s.length for s in segs) == 4000


def test_nothing_is_exposed_before_the_last_message():
    chunks = list(iter_chunks(_state().items(), version=1, bucket_bytes=4 * KIB))
    st = _stage(chunks[:-1])
    assert not st.complete
    with pytest.raises(PushError, match="incomplete"):
        st.tensors()


def test_a_missing_middle_message_is_detected():
    chunks = list(iter_chunks(_state().items(), version=1, bucket_bytes=4 * KIB))
    with pytest.raises(PushError, match="big"):
        _stage(chunks[:5] + chunks[6:])


def test_totals_on_the_last_message_are_checked():
    chunks = list(iter_chunks([("a", torch.ones(4)), ("b", torch.ones(4))], version=1, bucket_bytes=KIB))
    last = chunks[-1]
    forged = pb.WeightChunk(version=1, segments=[s for s in last.segments if s.name == "a"],
                            data=last.data[:16], last=True, total_tensors=2, total_bytes=32)
    with pytest.raises(PushError, match="1 of 2 tensors"):
        _stage([forged])


def test_version_must_not_change_inside_a_push():
    a = list(iter_chunks([("w", torch.ones(1000))], version=1, bucket_bytes=KIB))
    b = list(iter_chunks([("w", torch.ones(1000))], version=2, bucket_bytes=KIB))
    with pytest.raises(PushError, match="version"):
        _stage([a[0], b[1]])


def test_expected_names_and_shapes_are_enforced_on_first_segment():
    chunks = list(iter_chunks([("w", torch.ones(2, 3))], version=1, bucket_bytes=KIB))
    with pytest.raises(PushError, match="'w' is not a weight"):
        _stage(chunks, expected={"v": (2, 3)})
    with pytest.raises(PushError, match=r"shape \[2, 3\], the model has \[3, 2\]"):
        _stage(chunks, expected={"w": (3, 2)})
    assert dict(_stage(chunks, expected={"w": (2, 3)}).tensors())["w"].shape == (2, 3)


def test_inconsistent_metadata_and_overruns_are_rejected():
    seg = pb.TensorSegment(name="w", dtype="float32", shape=[4], total_bytes=12, offset=0, length=12)
    with pytest.raises(PushError, match="shape"):
        _stage([pb.WeightChunk(version=1, segments=[seg], data=b"\0" * 12, last=True)])
    seg = pb.TensorSegment(name="w", dtype="complex64", shape=[1], total_bytes=8, offset=0, length=8)
    with pytest.raises(PushError, match="dtype"):
        _stage([pb.WeightChunk(version=1, segments=[seg], data=b"\0" * 8)])
    seg = pb.TensorSegment(name="w", dtype="float32", shape=[4], total_bytes=16, offset=0, length=16,
                           data_offset=8)
    with pytest.raises(PushError, match="runs past"):
        _stage([pb.WeightChunk(version=1, segments=[seg], data=b"\0" * 16)])


def test_max_bytes_limits_staging():
    chunks = list(iter_chunks([("w", torch.ones(1000))], version=1, bucket_bytes=KIB))
    st = Stager(max_bytes=1000)
    with pytest.raises(PushError, match="max_bytes"):
        st.add(chunks[0])


def test_bad_arguments_name_the_field():
    with pytest.raises(PushError, match="bucket_bytes"):
        list(iter_chunks([("w", torch.ones(1))], version=1, bucket_bytes=10))
    with pytest.raises(PushError, match="twice"):
        list(iter_chunks([("w", torch.ones(1)), ("w", torch.ones(1))], version=1))
    with pytest.raises(PushError, match="complex64"):
        list(iter_chunks([("w", torch.ones(1, dtype=torch.complex64))], version=1))


def test_zero_copy_encoding_is_a_valid_weight_chunk_both_ways():
    sd = _state()
    buckets = list(iter_buckets(sd.items(), version=4, bucket_bytes=4 * KIB))
    for b in buckets:
        raw = b.encode()
        assert pb.WeightChunk.FromString(raw) == b.to_message()  # any protobuf reader accepts it
        header, data = decode_chunk(raw)
        assert bytes(data) == b.to_message().data and not header.data
        assert list(header.segments) == list(b.header.segments) and header.last == b.header.last
        # and the decoder accepts the canonical encoding of a generated client (data in the middle)
        canon_header, canon_data = decode_chunk(b.to_message().SerializeToString())
        assert bytes(canon_data) == bytes(data) and canon_header == header
    st = Stager()
    for b in buckets:
        st.add(*decode_chunk(b.encode()))
    assert all(torch.equal(dict(st.tensors())[k], v) for k, v in sd.items())


def test_malformed_messages_are_push_errors():
    raw = next(iter_buckets([("w", torch.ones(10))], version=1)).encode()
    with pytest.raises(PushError, match="malformed"):
        decode_chunk(raw[:-5])
    with pytest.raises(PushError, match="malformed"):
        decode_chunk(b"\xff" * 12)


_HEAP_PROBE = """
import ctypes, sys
from services.transport.weights.memory import keep_freed_buffers
tuned = sys.argv[1] == "tuned"
if tuned:
    assert keep_freed_buffers() and keep_freed_buffers()  # a second call changes nothing
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
addr = libc.malloc(8 << 20)  # one message buffer
heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0].split("-"))
print(lo <= addr < hi)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc tuning")
@pytest.mark.parametrize("mode, on_heap", [("default", False), ("tuned", True)])
def test_keep_freed_buffers_puts_message_buffers_on_the_heap(mode, on_heap):
    # glibc's default mmap threshold (128 KiB) gives an 8 MiB buffer its own mapping (fresh pages,
    # page faults every message); once tuned, the buffer comes from the reusable heap
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == str(on_heap), out.stderr


def _stage_into(pool: StagingPool, t: torch.Tensor, version: int) -> torch.Tensor:
    stager = Stager(pool=pool)
    for chunk in iter_chunks([("w", t)], version=version, bucket_bytes=1 << 10):
        stager.add(chunk)
    return dict(stager.tensors())["w"]


def test_staging_pool_hands_adopted_buffers_over_and_takes_back_only_its_own():
    pool = StagingPool()
    original = torch.zeros(64, 8)  # the engine's own weights: never staged into
    first = _stage_into(pool, torch.full((64, 8), 1.0), 1)
    pool.handoff("w", first, original)  # the engine now serves `first`
    assert pool.nbytes == 0
    second = _stage_into(pool, torch.full((64, 8), 2.0), 2)
    assert second.data_ptr() not in (first.data_ptr(), original.data_ptr())
    assert torch.equal(first, torch.full((64, 8), 1.0)) and torch.equal(original, torch.zeros(64, 8))
    pool.handoff("w", second, first)  # `first` was lent by the pool: it is the next staging buffer
    third = _stage_into(pool, torch.full((64, 8), 3.0), 3)
    assert third.data_ptr() == first.data_ptr() and torch.equal(second, torch.full((64, 8), 2.0))
    # a tensor the engine copied (not the pool's buffer) leaves the pool as it was
    pool.handoff("w", third.clone(), second)
    assert _stage_into(pool, torch.full((64, 8), 4.0), 4).data_ptr() == first.data_ptr()
