"""The chunked LM head + log-softmax (services/trainer/logprobs.py) equals the plain, unchunked
autograd computation in values and gradients, keeps no [tokens, vocab] tensor for backward, and is
transparent to a training step; restricted to the loss positions (``positions``, with or without the
entropy), a masked loss keeps its value and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.logprobs import token_logprobs
from services.trainer.packing import TrainSample
from services.trainer.step import StepSettings, train_step


def _reference(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, temperature: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The unchunked definition: full [B, L, V] logits through autograd's own ops."""
    logits = (h @ w.T).float() / temperature
    logp = torch.log_softmax(logits[:, :-1], -1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros(h.shape[0], 1)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


@pytest.mark.parametrize("chunk", [1, 4, 7, 11, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_unchunked_computation(chunk, temperature):
    gen = torch.Generator().manual_seed(chunk)
    h = torch.randn(2, 6, 8, generator=gen, requires_grad=True)
    w = (torch.randn(13, 8, generator=gen) * 2).requires_grad_()
    ids = torch.randint(0, 13, (2, 6), generator=gen)
    g_lp, g_ent = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)
    lp, ent = token_logprobs(h, w, ids, temperature=temperature, chunk_tokens=chunk)
    ref_lp, ref_ent = _reference(h, w, ids, temperature)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert lp[:, 0].abs().max() == 0 and ent[:, 0].abs().max() == 0
    # each output alone, then a random mix (upstream grads of any sign, as the PPO loss gives)
    for a, b in [(lp.sum(), ref_lp.sum()), (ent.sum(), ref_ent.sum()),
                 ((lp * g_lp + ent * g_ent).sum(), (ref_lp * g_lp + ref_ent * g_ent).sum())]:
        got = torch.autograd.grad(a, (h, w), retain_graph=True)
        want = torch.autograd.grad(b, (h, w), retain_graph=True)
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_gradient_to_one_input_only_and_none_needed():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(1, 9, 8, generator=gen)
    w = torch.randn(13, 8, generator=gen)
    ids = torch.randint(0, 13, (1, 9), generator=gen)
    for needs in [(True, False), (False, True)]:
        hh, ww = h.clone().requires_grad_(needs[0]), w.clone().requires_grad_(needs[1])
        lp, ent = token_logprobs(hh, ww, ids, chunk_tokens=4)
        ref_lp, ref_ent = _reference(hh, ww, ids, 1.0)
        x = hh if needs[0] else ww
        got, = torch.autograd.grad((lp - 0.3 * ent).sum(), x)
        want, = torch.autograd.grad((ref_lp - 0.3 * ref_ent).sum(), x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        lp, _ = token_logprobs(h, w, ids, chunk_tokens=4)
    assert not lp.requires_grad


def test_bf16_weights_match_the_unchunked_computation_in_bf16():
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(1, 10, 16, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(17, 16, generator=gen).bfloat16().requires_grad_()
    ids = torch.randint(0, 17, (1, 10), generator=gen)
    lp, ent = token_logprobs(h, w, ids, chunk_tokens=3)
    ref_lp, ref_ent = _reference(h, w, ids, 1.0)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-4)
    got = torch.autograd.grad((lp + ent).sum(), (h, w))
    want = torch.autograd.grad((ref_lp + ref_ent).sum(), (h, w))
    for x, y in zip(got, want, strict=True):
        assert x.dtype == torch.bfloat16
        torch.testing.assert_close(x, y, atol=2e-2, rtol=2e-2)


def test_nothing_of_size_tokens_times_vocab_is_kept_for_backward():
    n, vocab, width = 64, 500, 8
    h = torch.randn(1, n, width, requires_grad=True)
    w = torch.randn(vocab, width, requires_grad=True)
    ids = torch.randint(0, vocab, (1, n))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = token_logprobs(h, w, ids, chunk_tokens=16)
    assert saved and max(saved) <= vocab * width, saved  # h, W, targets, entropy: never [n, vocab]
    (lp + ent).sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        _reference(h, w, ids, 1.0)
    assert max(saved) >= (n - 1) * vocab  # guards the hook: autograd's own ops keep the logits


def test_bad_arguments_are_refused_naming_them():
    h, w, ids = torch.randn(1, 3, 4), torch.randn(5, 4), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(h, w, ids, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, ids, temperature=0.0)


def _same_step(actors: list[Actor], samples: Any, settings: Any, *, atol: float, rel: float,
               abs_: float) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, float]]]:
    """One SGD step (parameter change = lr x gradient) of each actor on the same samples; asserts
    that they end with the same parameters (``atol``, rtol 1e-5) and metrics (``rel``, ``abs_``)."""
    params, metrics = [], []
    for actor in actors:
        opt = torch.optim.SGD(actor.parameters(), lr=0.5)
        metrics.append(train_step(actor, opt, samples, settings))
        params.append({k: v.detach().clone() for k, v in actor.state_dict().items()})
    for k in params[0]:
        torch.testing.assert_close(params[0][k], params[1][k], atol=atol, rtol=1e-5)
    assert metrics[0].keys() == metrics[1].keys()
    for k in metrics[0]:
        assert metrics[0][k] == pytest.approx(metrics[1][k], rel=rel, abs=abs_), k
    return params, metrics


def test_chunking_is_transparent_to_a_training_step():
    gen = torch.Generator().manual_seed(7)
    samples = []
    for n in (23, 9, 31, 17):
        ids = torch.randint(0, 256, (n,), generator=gen)
        mask = torch.zeros(n)
        mask[n // 3:] = 1
        adv = mask * torch.randn(n, generator=gen)
        samples.append(TrainSample(input_ids=ids, loss_mask=mask, advantages=adv,
                                   rollout_logprobs=-torch.rand(n, generator=gen)))
    settings = StepSettings(mini_batch_size=2, micro_batch_max_tokens=64, entropy_coeff=0.01)
    params, _ = _same_step([Actor(tiny_qwen2(seed=3), chunk_tokens=chunk) for chunk in (5, 10**6)],
                           samples, settings, atol=1e-5, rel=1e-4, abs_=1e-6)
    initial = Actor(tiny_qwen2(seed=3)).state_dict()["lm.lm_head.weight"]
    assert params[0]["lm.lm_head.weight"].ne(initial).any()  # the step did move the head


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_positions_give_the_masked_loss_and_gradients_of_all_positions(chunk, with_entropy):
    """Only the marked positions through the head: a loss weighted by that mask has the same value and
    gradients as with every position computed; the other positions are 0 (entropy too when off)."""
    gen = torch.Generator().manual_seed(11 + chunk)
    h = torch.randn(2, 7, 8, generator=gen, requires_grad=True)
    w = (torch.randn(13, 8, generator=gen) * 2).requires_grad_()
    ids = torch.randint(0, 13, (2, 7), generator=gen)
    mask = torch.rand(2, 7, generator=gen) > 0.5
    mask[:, 0] = False
    mask[0, 3] = True
    g_lp, g_ent = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    lp, ent = token_logprobs(h, w, ids, temperature=0.8, chunk_tokens=chunk, positions=mask,
                             entropy=with_entropy)
    ref_lp, ref_ent = _reference(h, w, ids, 0.8)
    m = mask.float()
    torch.testing.assert_close(lp, ref_lp * m, atol=1e-5, rtol=1e-5)
    want_ent = ref_ent * m if with_entropy else torch.zeros_like(ent)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    losses = [((lp * g_lp * m).sum(), (ref_lp * g_lp * m).sum())]
    if with_entropy:  # an entropy bonus on the mask as well
        losses.append((((lp * g_lp + ent * g_ent) * m).sum(), ((ref_lp * g_lp + ref_ent * g_ent) * m).sum()))
    for a, b in losses:
        got = torch.autograd.grad(a, (h, w), retain_graph=True)
        want = torch.autograd.grad(b, (h, w), retain_graph=True)
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    assert torch.autograd.grad(lp.sum(), h, retain_graph=True)[0][~mask.roll(-1, 1)].abs().max() == 0


def test_positions_on_the_real_qwen_vocabulary_equal_the_unchunked_masked_loss():
    """151,936 rows (Qwen2.5's): the SFT loss (-mean log p over the mask), head on mask positions and
    no entropy, against the full [T, vocab] log-softmax through autograd."""
    gen = torch.Generator().manual_seed(5)
    vocab, n = 151_936, 40
    h = torch.randn(1, n, 16, generator=gen, requires_grad=True)
    w = (torch.randn(vocab, 16, generator=gen) * 0.3).requires_grad_()
    ids = torch.randint(0, 151_665, (1, n), generator=gen)
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, 25:] = True
    lp, ent = token_logprobs(h, w, ids, chunk_tokens=8, positions=mask, entropy=False)
    ref_lp, _ = _reference(h, w, ids, 1.0)
    loss, ref = -(lp * mask).sum() / mask.sum(), -(ref_lp * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)
    assert ent.abs().max() == 0
    got, want = torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-4)


def test_no_position_marked_gives_zeros_and_zero_gradients():
    h = torch.randn(1, 5, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    ids = torch.randint(0, 9, (1, 5))
    lp, ent = token_logprobs(h, w, ids, positions=torch.zeros(1, 5, dtype=torch.bool))
    assert lp.abs().max() == 0 and ent.abs().max() == 0
    gh, gw = torch.autograd.grad((lp + ent).sum(), (h, w))
    assert gh.abs().max() == 0 and gw.abs().max() == 0
    with pytest.raises(ValueError, match="positions"):
        token_logprobs(h, w, ids, positions=torch.ones(1, 4, dtype=torch.bool))


class _EveryPosition(Actor):
    """The actor as it was: the LM head over every position, whatever ``positions`` says."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(input_ids, position_ids, attention_mask)


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_a_training_step_with_the_head_on_loss_positions_equals_every_position(entropy_coeff):
    """The RL step passes the loss mask as ``positions``: same parameters after the step (recompute,
    mismatch, policy loss, entropy bonus, KL) and the same metrics as the head on every position."""
    gen = torch.Generator().manual_seed(8)
    samples = []
    for n in (23, 9, 31, 17):
        ids = torch.randint(0, 256, (n,), generator=gen)
        mask = torch.zeros(n)
        mask[n // 3:] = 1
        mask[n // 2] = 0  # a tool-result token inside the response
        adv = mask * torch.randn(1, generator=gen)
        samples.append(TrainSample(input_ids=ids, loss_mask=mask, advantages=adv,
                                   rollout_logprobs=-torch.rand(n, generator=gen) * mask,
                                   ref_logprobs=-torch.rand(n, generator=gen) * mask))
    settings = StepSettings(mini_batch_size=2, micro_batch_max_tokens=64, entropy_coeff=entropy_coeff,
                            kl_coef=0.1, tis_cap=2.0)
    _same_step([cls(tiny_qwen2(seed=3), chunk_tokens=7) for cls in (Actor, _EveryPosition)],
               samples, settings, atol=1e-6, rel=1e-5, abs_=1e-7)
