"""Per-token log-probs and entropy from hidden states, without materialising all logits.

Invariant: ``out[..., t] = log softmax(h[t-1] W^T / T)[ids[t]]`` for t >= 1 and 0 at t = 0; the
entropy at t is that of the same distribution. With ``positions`` (a ``[B, L]`` mask) only the
positions it marks are computed (the LM head runs on their hidden states alone) and every other
position is 0 in both outputs: a loss that weights the others by 0 (SFT's assistant mask, the RL
response mask) has the same value and the same gradients as with every position computed. With
``entropy=False`` the entropy is 0 everywhere and not computed. Logits exist for at most
``chunk_tokens`` positions at a time, in fp32, and at most two such ``[chunk_tokens, vocab]``
buffers are alive at once (one without entropy), in forward and in backward: the LM head,
log-softmax, gather and entropy are one autograd node (``_LinearLogProbs``) that keeps only ``h``,
``W``, the targets and one float per position (the entropy), and recomputes each chunk's logits in
backward, where it writes the gradient of the logits in place. Peak memory is
O(chunk_tokens × vocab), independent of the sequence length. (The previous head ran autograd's
``logsumexp``/``softmax`` per chunk under ``torch.utils.checkpoint``: in backward the recomputed
logits and softmax of all chunks were alive together, so its peak grew with T: 9.6 GiB at 4,352
tokens with Qwen's 151,936 rows, past 22 GiB at 16,640; this one: 2.4 and 2.8 GiB.
bench/qwen_long.py, docs/benchmarks.md.)

Gradients (``z`` the logits of a position, ``p = softmax(z)``, ``H`` its entropy, ``y`` its target):
``d lp / dz = onehot(y) - p`` and ``d H / dz = -p * (log p + H)``; both are scaled by ``1/T``
for the temperature.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F


def _shifted_logits(h: torch.Tensor, weight: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """``z - max(z)`` per row, ``z = h W^T · inv_temp`` in fp32, ``[n, V]`` (one buffer, in place)."""
    z = F.linear(h, weight).float()
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    return z.sub_(z.amax(dim=-1, keepdim=True))


def _log_probs_and_probs(h: torch.Tensor, weight: torch.Tensor, inv_temp: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p, p)`` of ``softmax(h W^T · inv_temp)``, fp32 ``[n, V]`` each: one exp, two buffers."""
    logp = _shifted_logits(h, weight, inv_temp)
    p = torch.exp(logp)
    total = p.sum(dim=-1, keepdim=True)
    p.div_(total)
    return logp.sub_(total.log_()), p


class _LinearLogProbs(torch.autograd.Function):
    """``(h [N, H], W [V, H], targets [N])`` -> ``(logprob [N], entropy [N])``, fp32, by chunks."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temp: float,
                chunk_tokens: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.zeros(n, dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            tgt = targets[s:e].unsqueeze(-1)
            if with_entropy:
                logp, p = _log_probs_and_probs(h[s:e], weight, inv_temp)
                lp[s:e] = logp.gather(-1, tgt).squeeze(-1)
                # -Σ p log p as a batched dot product: no third [n, V] buffer
                ent[s:e] = -torch.bmm(p.unsqueeze(1), logp.unsqueeze(2)).view(-1)
                del logp, p
            else:  # log p(y) = z_y - log Σ exp z, the exp written over z: one buffer
                z = _shifted_logits(h[s:e], weight, inv_temp)
                zy = z.gather(-1, tgt).squeeze(-1)
                lp[s:e] = zy - z.exp_().sum(dim=-1).log_()
                del z
        ctx.save_for_backward(h, weight, targets, ent)
        ctx.set_materialize_grads(False)  # an output nothing differentiates arrives as None
        ctx.inv_temp, ctx.chunk_tokens, ctx.with_entropy = inv_temp, chunk_tokens, with_entropy
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        h, weight, targets, ent = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, step = h.shape[0], ctx.chunk_tokens
        if g_lp is None:
            g_lp = torch.zeros(n, dtype=torch.float32, device=h.device)
        # the entropy's gradient only when a loss used it (an entropy bonus; a metric does not)
        use_ent = ctx.with_entropy and g_ent is not None
        grad_h = torch.empty_like(h) if want_h else None
        grad_w: torch.Tensor | None = None
        for s in range(0, n, step):
            e = min(s + step, n)
            hc, glp = h[s:e], g_lp[s:e].unsqueeze(-1)
            if use_ent:
                assert g_ent is not None
                gz, p = _log_probs_and_probs(hc, weight, ctx.inv_temp)  # log p, p
                # dL/dz = g_lp * onehot(y) - p * (g_lp + g_ent * (log p + H)), written over log p
                gz.add_(ent[s:e].unsqueeze(-1)).mul_(g_ent[s:e].unsqueeze(-1)).add_(glp).mul_(p).neg_()
                del p
            else:  # dL/dz = g_lp * (onehot(y) - p), p written over the logits: one buffer
                gz = _shifted_logits(hc, weight, ctx.inv_temp).exp_()
                gz.mul_(glp.neg() / gz.sum(dim=-1, keepdim=True))
            gz.scatter_add_(-1, targets[s:e].unsqueeze(-1), glp)
            if ctx.inv_temp != 1.0:
                gz.mul_(ctx.inv_temp)
            gz = gz.to(h.dtype)
            if grad_h is not None:
                torch.mm(gz, weight, out=grad_h[s:e])
            if want_w:
                part = gz.t().mm(hc)
                grad_w = part if grad_w is None else grad_w.add_(part)
            del gz
        if want_w and grad_w is None:
            grad_w = torch.zeros_like(weight)
        return grad_h, grad_w, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, *, temperature: float = 1.0,
    chunk_tokens: int = 4096, positions: torch.Tensor | None = None, entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [B, L, H]``, ``weight [V, H]``, ``input_ids [B, L]`` -> (logprobs, entropy) ``[B, L]``.

    ``positions [B, L]`` (bool or 0/1): compute only the positions it marks, 0 elsewhere (the LM head
    runs on those positions' hidden states only); ``entropy=False``: the entropy is all 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    bsz, length, width = hidden.shape
    if positions is not None and positions.shape != input_ids.shape:
        raise ValueError(f"positions has shape {tuple(positions.shape)}, input_ids {tuple(input_ids.shape)}")
    h = hidden[:, :-1].reshape(-1, width)
    tgt = input_ids[:, 1:].reshape(-1)
    keep = None
    if positions is not None:
        keep = positions[:, 1:].reshape(-1).to(device=h.device).nonzero().squeeze(-1)
        h, tgt = h.index_select(0, keep), tgt.index_select(0, keep)
    lp, ent = _LinearLogProbs.apply(h, weight, tgt, 1.0 / temperature, chunk_tokens, entropy)
    if keep is not None:
        flat = bsz * (length - 1)
        lp = torch.zeros(flat, dtype=lp.dtype, device=lp.device).index_copy(0, keep, lp)
        ent = torch.zeros(flat, dtype=ent.dtype, device=ent.device).index_copy(0, keep, ent)
    zero = torch.zeros(bsz, 1, dtype=torch.float32, device=hidden.device)
    lp_all = torch.cat([zero, lp.view(bsz, length - 1)], dim=1)
    ent_all = torch.cat([zero, ent.view(bsz, length - 1)], dim=1)
    return lp_all, ent_all
