"""Packed (padding-free) forward == per-sequence forward; packers respect budgets; chunked log-probs."""

from __future__ import annotations

import pytest
import torch

from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.logprobs import token_logprobs
from services.trainer.packing import (
    TrainSample,
    pack,
    pad,
    plan_equal_micro_batches,
    plan_micro_batches,
    split_into,
)


def _sample(n: int, gen: torch.Generator) -> TrainSample:
    ids = torch.randint(0, 256, (n,), generator=gen)
    mask = torch.zeros(n)
    mask[n // 3:] = 1
    return TrainSample(input_ids=ids, loss_mask=mask, advantages=mask * 0.5)


@pytest.mark.parametrize("attn,varlen", [("sdpa", True), ("sdpa", False), ("eager", False)])
def test_packed_forward_matches_separate_sequences(attn, varlen):
    # varlen=False: transformers' own packed-sequence detection from position_ids (block mask)
    gen = torch.Generator().manual_seed(3)
    samples = [_sample(n, gen) for n in (7, 19, 3, 12)]
    actor = Actor(tiny_qwen2(attn_implementation=attn, seed=1), chunk_tokens=5, varlen_packed=varlen).eval()
    with torch.no_grad():
        mb = pack(samples)
        lp_packed, ent_packed = actor(mb.input_ids, mb.position_ids, None)
        padded = pad(samples)
        lp_pad, _ = actor(padded.input_ids, padded.position_ids, padded.attention_mask)
        offset = 0
        for i, s in enumerate(samples):
            n = len(s)
            ids = s.input_ids.unsqueeze(0)
            lp_one, ent_one = actor(ids, torch.arange(n).unsqueeze(0), None)
            # position 0 of each sequence is a prompt token (mask 0): compare from t=1
            torch.testing.assert_close(lp_packed[0, offset + 1:offset + n], lp_one[0, 1:], atol=1e-5, rtol=0)
            torch.testing.assert_close(ent_packed[0, offset + 1:offset + n], ent_one[0, 1:],
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(lp_pad[i, 1:n], lp_one[0, 1:], atol=1e-5, rtol=0)
            offset += n


@pytest.mark.parametrize("varlen", [True, False])
def test_packed_forward_differs_without_position_reset(varlen):
    # guards the test above: if boundaries were ignored, sequence 2 would see sequence 1
    gen = torch.Generator().manual_seed(4)
    samples = [_sample(n, gen) for n in (9, 9)]
    actor = Actor(tiny_qwen2(seed=2), varlen_packed=varlen).eval()
    with torch.no_grad():
        mb = pack(samples)
        good, _ = actor(mb.input_ids, mb.position_ids, None)
        wrong, _ = actor(mb.input_ids, torch.arange(18).unsqueeze(0), None)
    assert (good[0, 10:] - wrong[0, 10:]).abs().max() > 1e-3


def test_chunked_logprobs_match_full_log_softmax_and_grad():
    torch.manual_seed(0)
    h = torch.randn(2, 6, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    ids = torch.randint(0, 11, (2, 6))
    lp, ent = token_logprobs(h, w, ids, temperature=0.7, chunk_tokens=4)
    logits = (h @ w.T).float() / 0.7
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    p = torch.softmax(logits[:, :-1], -1)
    ref_ent = -(p * torch.log_softmax(logits[:, :-1], -1)).sum(-1)
    torch.testing.assert_close(lp[:, 1:], ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[:, 1:], ref_ent, atol=1e-5, rtol=0)
    assert lp[:, 0].abs().max() == 0
    g1 = torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
    g2 = torch.autograd.grad(ref.sum() + ref_ent.sum(), (h, w))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_plan_micro_batches_budget_and_cover():
    lengths = [50, 2000, 700, 1300, 90, 400, 1600, 60, 1000, 333]
    bins = plan_micro_batches(lengths, 2048)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
    assert len(bins) == 4  # total 7533 tokens -> at least 4 bins of 2048; FFD reaches it
    with pytest.raises(ValueError, match="micro_batch_max_tokens=1000"):
        plan_micro_batches([10, 1001], 1000)


def test_equal_micro_batch_counts_across_ranks():
    plans = plan_equal_micro_batches([[900, 900, 900], [100]], 1000)
    assert len(plans[0]) == len(plans[1]) == 3
    assert sorted(len(b) for b in plans[1]) == [0, 0, 1]  # empty bins are run as no-op micro-batches
    assert split_into([5, 5, 5], 2, max_tokens=9) is None


def test_sample_validation_names_field():
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        TrainSample(input_ids=torch.tensor([1, 2]), loss_mask=torch.tensor([1.0, 1.0]),
                    advantages=torch.zeros(2))
    with pytest.raises(ValueError, match="advantages has 3"):
        TrainSample(input_ids=torch.tensor([1, 2]), loss_mask=torch.tensor([0.0, 1.0]),
                    advantages=torch.zeros(3))
