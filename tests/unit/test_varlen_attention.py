"""Packed varlen attention: every backend computes causal attention within each sequence only."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from services.trainer import varlen_attention as va


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each sequence on its own through SDPA, kv heads repeated by hand (no GQA flag)."""
    rep = q.shape[1] // k.shape[1]
    outs, at = [], 0
    for n in lengths:
        sl = slice(at, at + n)
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        qs, ks, vs = (x[sl].transpose(0, 1)[None] for x in (q, kr, vr))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
        at += n
    return torch.cat(outs)


def test_segments_from_position_ids() -> None:
    seg = va.segments_of(torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]]))
    assert seg.lengths == (3, 1, 4)
    assert seg.cu_seqlens.tolist() == [0, 3, 4, 8] and seg.cu_seqlens.dtype == torch.int32
    assert seg.max_len == 4
    # a row that does not start at position 0 still starts a sequence at index 0
    assert va.segments_of(torch.tensor([[5, 6, 0, 1]])).lengths == (2, 2)


def test_loop_matches_per_sequence_attention_and_gradients() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    n = sum(lengths)
    q = torch.randn(n, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(n, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(n, 2, 8, generator=gen, requires_grad=True)
    seg = va.segments_of(torch.cat([torch.arange(m) for m in lengths])[None])
    out = va.packed_attention(q, k, v, seg, backend="loop")
    ref = _reference(q, k, v, lengths)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)
    # guard: ignoring the boundaries changes the output (the test above can fail)
    one = va.segments_of(torch.arange(n)[None])
    assert not torch.allclose(va.packed_attention(q, k, v, one, backend="loop"), ref)


def test_cpu_runs_the_loop_and_refuses_a_kernel_it_lacks() -> None:
    assert va.available_backends("cpu", torch.float32) == ["loop"]
    assert va.available_backends("cpu", torch.bfloat16) == ["loop"]
    q = torch.randn(4, 2, 8)
    seg = va.segments_of(torch.tensor([[0, 1, 0, 1]]))
    with pytest.raises(ValueError, match="torch_varlen.*not available.*available: \\['loop'\\]"):
        va.packed_attention(q, q, q, seg, backend="torch_varlen")


def test_transformers_hook_uses_the_segments_given_once_per_forward() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, generator=gen)
    kv = torch.randn(1, 2, 6, 8, generator=gen)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    own, _ = va.varlen_attention_forward(torch.nn.Module(), q, kv, kv, None, position_ids=pos)
    given, _ = va.varlen_attention_forward(torch.nn.Module(), q, kv, kv, None, position_ids=pos,
                                           **{va.SEGMENTS_KWARG: va.segments_of(pos)})
    torch.testing.assert_close(own, given)
    # the given segments win over position_ids: one 6-token sequence is a different answer
    whole, _ = va.varlen_attention_forward(torch.nn.Module(), q, kv, kv, None, position_ids=pos,
                                           **{va.SEGMENTS_KWARG: va.segments_of(torch.arange(6)[None])})
    assert own.shape == (1, 6, 4, 8) and not torch.allclose(own, whole)
    with pytest.raises(ValueError, match="one packed row"):
        va.varlen_attention_forward(torch.nn.Module(), q, kv, kv, torch.ones(1, 6), position_ids=pos)


def _fake_kernel(q, k, v, cu, max_len):
    """What torch's flash varlen kernel computes (it runs on CUDA only): causal attention per segment."""
    bounds = cu.tolist()
    assert max_len == max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    return _reference(q, k, v, [b - a for a, b in zip(bounds, bounds[1:], strict=False)])


@pytest.mark.parametrize("api", ["2.10", "2.11+"])
def test_torch_varlen_adapter_speaks_each_torch_signature(monkeypatch, api) -> None:
    # the CUDA kernel cannot run here: a stand-in with each torch version's signature checks what the
    # adapter passes (causal flag, GQA, scale); the real kernel is compared with the loop in bench.gpu
    import torch.nn.attention.varlen as tv

    calls = []
    if api == "2.10":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
            calls.append({"is_causal": is_causal, "kv_heads": key.shape[1]})
            return _fake_kernel(query, key, value, cu_seq_q, max_q)
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False):
            calls.append({"window_size": tuple(window_size), "gqa": enable_gqa, "scale": scale})
            assert enable_gqa == (key.shape[1] != query.shape[1])
            return _fake_kernel(query, key, value, cu_seq_q, max_q)

    monkeypatch.setattr(tv, "varlen_attn", fake)
    va._torch_varlen.cache_clear()
    try:
        run = va._torch_varlen()
        assert run is not None
        gen = torch.Generator().manual_seed(2)
        lengths = [3, 6]
        q = torch.randn(9, 4, 8, generator=gen)
        k, v = torch.randn(9, 2, 8, generator=gen), torch.randn(9, 2, 8, generator=gen)
        seg = va.segments_of(torch.cat([torch.arange(n) for n in lengths])[None])
        torch.testing.assert_close(run(q, k, v, seg, 8 ** -0.5), _reference(q, k, v, lengths))
        if api == "2.10":
            assert calls == [{"is_causal": True, "kv_heads": 4}]  # kv heads repeated: no GQA flag there
            with pytest.raises(ValueError, match="takes no scale"):
                run(q, k, v, seg, 0.5)
        else:
            assert calls == [{"window_size": (-1, 0), "gqa": True, "scale": 8 ** -0.5}]
    finally:
        va._torch_varlen.cache_clear()
