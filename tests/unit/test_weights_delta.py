"""DeltaEncoder / decode_sparse / SparsePatch: bit-identical chains, FULL fallback, malformed payloads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.proto_gen import retool_pb2 as pb
from services.transport.weights import delta as delta_mod
from services.transport.weights.bucketing import PushError, PushKind, Stager, WireTensor, iter_chunks
from services.transport.weights.delta import DeltaEncoder, SparsePatch, decode_sparse


def _bits(t: torch.Tensor) -> np.ndarray:
    return delta_mod.int_view(t.contiguous()).copy()


def _apply(served: dict[str, torch.Tensor], tensors: list[WireTensor]) -> None:
    """What a replica does with a delta (SPARSE patched in place, FULL replaced)."""
    for w in tensors:
        target = served[w.name]
        payload = np.frombuffer(w.payload, dtype=np.uint8)
        if w.encoding == pb.SPARSE:
            patch = decode_sparse(w.name, target.dtype, target.numel(), w.changed, payload)
            patch.validate(target)
            patch.apply(target)
        else:
            delta_mod.int_view(target)[:] = payload.view(delta_mod.int_view(target).dtype)


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_chain_of_deltas_is_bit_identical_to_the_cast_of_the_master(monkeypatch, dtype, where):
    # where="device" runs its torch compare on the masters' device: the CPU here, the GPU in bench.gpu
    monkeypatch.setattr(delta_mod, "CHUNK_ELEMENTS", 1000)  # several chunks per tensor, in threads
    gen = torch.Generator().manual_seed(0)
    master = {"a": torch.randn(37, 101, generator=gen) * 0.02, "b": torch.randn(5000, generator=gen),
              "norm": torch.ones(64)}
    enc = DeltaEncoder(dtype, threads=2, where=where)
    assert enc.update(master.items(), 1) is None  # nothing to compare with: a full push
    served = {n: t.clone() for n, t in enc.full()}
    for version in range(2, 12):
        for name, lr in (("a", 2e-6), ("b", 1e-4)):  # AdamW-like steps: a few cross a rounding boundary
            master[name] -= lr * torch.sign(torch.randn(master[name].shape, generator=gen))
        if version == 5:
            master["a"][3, 7] = float("nan")
            master["b"][11] = -0.0  # differs from +0.0 only in its bits
        delta = enc.update(master.items(), version)
        assert delta is not None and (delta.base_version, delta.version) == (version - 1, version)
        assert "norm" not in {w.name for w in delta.tensors}  # unchanged tensors are not sent
        _apply(served, delta.tensors)
        for name, t in master.items():
            want = _bits(t.to(dtype))
            assert np.array_equal(_bits(served[name]), want), (version, name)
            assert np.array_equal(_bits(dict(enc.full())[name]), want)
        if dtype == torch.bfloat16:
            assert 0 < delta.density < 0.5 and delta.payload_bytes < 0.5 * delta.full_bytes
            assert all(w.encoding == pb.SPARSE for w in delta.tensors)


@pytest.mark.parametrize("where", ["host", "device"])
def test_dense_changes_go_full_and_other_shapes_restart_the_shadow(where):
    enc = DeltaEncoder(torch.float32, threads=1, where=where)
    enc.update([("w", torch.zeros(1000))], 1)
    delta = enc.update([("w", torch.arange(1000.0))], 2)  # every element changed
    assert delta is not None and [w.encoding for w in delta.tensors] == [pb.FULL]
    assert delta.tensors[0].payload_bytes == 4000 and delta.density > 0.99
    sparse = enc.update([("w", torch.arange(1000.0).index_fill(0, torch.tensor([7]), -1.0))], 3)
    assert sparse is not None and sparse.tensors[0].encoding == pb.SPARSE and sparse.tensors[0].changed == 1
    assert enc.update([("w", torch.zeros(10))], 4) is None  # another shape: the shadow starts again
    assert enc.update([("w", torch.ones(10))], 5, compare=False) is None and enc.version == 5
    assert torch.equal(dict(enc.full())["w"], torch.ones(10))
    empty = enc.update([("w", torch.ones(10))], 6)
    assert empty is not None and empty.tensors == [] and empty.changed == 0


def test_host_and_device_compares_send_the_same_sparse_payloads():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 70, generator=gen) * 0.02
    host, dev = DeltaEncoder(torch.bfloat16, threads=2), DeltaEncoder(torch.bfloat16, where="device")
    for enc in (host, dev):
        enc.update([("w", w)], 1)
    w2 = w - 2e-6 * torch.sign(torch.randn(w.shape, generator=gen))
    a, b = host.update([("w", w2)], 2), dev.update([("w", w2)], 2)
    assert a is not None and b is not None and 0 < a.changed == b.changed < w.numel() // 4
    assert [(t.encoding, t.changed, bytes(t.payload)) for t in a.tensors] == \
        [(t.encoding, t.changed, bytes(t.payload)) for t in b.tensors]


def _sparse(idx: list[int], values: list[int], dtype=np.int16) -> np.ndarray:
    return np.concatenate([np.array(idx, dtype="<u4").view(np.uint8),
                           np.array(values, dtype=dtype).view(np.uint8)])


def test_malformed_sparse_payloads_are_refused_naming_the_tensor():
    ok = decode_sparse("w", torch.bfloat16, 10, 2, _sparse([1, 9], [5, 6]))
    assert list(ok.indices) == [1, 9]
    with pytest.raises(PushError, match="'w'.*outside"):
        decode_sparse("w", torch.bfloat16, 10, 2, _sparse([1, 10], [5, 6]))
    with pytest.raises(PushError, match="ascending"):
        decode_sparse("w", torch.bfloat16, 10, 2, _sparse([4, 4], [5, 6]))
    with pytest.raises(PushError, match="payload of"):
        decode_sparse("w", torch.bfloat16, 10, 3, _sparse([1, 2], [5, 6]))
    with pytest.raises(PushError, match="changed elements"):
        decode_sparse("w", torch.bfloat16, 1, 2, _sparse([0, 1], [5, 6]))
    target = torch.zeros(10, dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16.*float32"):
        ok.validate(target)
    assert torch.equal(target, torch.zeros(10))


def test_patch_applies_to_a_non_contiguous_tensor():
    base = torch.zeros(4, 6, dtype=torch.bfloat16)
    view = base.t()  # (6, 4), not contiguous
    values = torch.tensor([1.5, -2.0], dtype=torch.bfloat16).view(torch.int16).numpy()
    patch = SparsePatch("w", torch.bfloat16, np.array([0, 5], dtype=np.uint32), values)
    patch.validate(view)
    patch.apply(view)
    assert view.reshape(-1)[0] == 1.5 and view.reshape(-1)[5] == -2.0 and view.count_nonzero() == 2


def test_sparse_tensors_only_in_a_delta_push_and_the_push_fields_are_staged():
    enc = DeltaEncoder(torch.bfloat16, threads=1)
    enc.update([("w", torch.zeros(100))], 1)
    delta = enc.update([("w", torch.zeros(100).index_fill(0, torch.tensor([3, 50]), 1.0))], 2)
    assert delta is not None
    with pytest.raises(PushError, match="only a delta push"):
        list(iter_chunks(delta.tensors, 2))
    kind = PushKind(delta=True, base_version=1, lineage=enc.lineage)
    chunks = list(iter_chunks(delta.tensors, 2, bucket_bytes=1024, kind=kind))
    stager = Stager({"w": (100,)})
    for c in chunks:
        stager.add(c)
    assert stager.delta and stager.kind == kind and stager.tensors() == [] and stager.changed() == 2
    (enc_t,) = stager.encoded()
    patch = decode_sparse("w", enc_t.dtype, 100, enc_t.changed, enc_t.payload)
    assert list(patch.indices) == [3, 50]
    forged = pb.WeightChunk()
    forged.CopyFrom(chunks[0])
    forged.delta = False  # a SPARSE tensor in a full push
    with pytest.raises(PushError, match="only valid in a delta push"):
        Stager().add(forged)
    mixed = [pb.WeightChunk(version=2, delta=True, base_version=1, lineage="x"),
             pb.WeightChunk(version=2, delta=True, base_version=0, lineage="x", last=True)]
    stager = Stager()
    stager.add(mixed[0])
    with pytest.raises(PushError, match="changed inside a push"):
        stager.add(mixed[1])
