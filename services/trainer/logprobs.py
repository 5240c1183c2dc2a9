"""Per-token log-probs and entropy from hidden states, without materialising all logits.

Invariant: ``out[..., t] = log softmax(h[t-1] W^T / T)[ids[t]]`` for t >= 1 and 0 at t = 0; the
entropy at t is that of the same distribution. Logits exist for at most ``chunk_tokens`` positions
at a time (in fp32); with gradients on, each chunk is recomputed in backward (checkpointed), so
peak memory is O(chunk_tokens × vocab) instead of O(tokens × vocab).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_fn(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temp: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(h, weight).float()
    if inv_temp != 1.0:
        logits = logits * inv_temp
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(-1)
    return lp, entropy


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, *, temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [B, L, H]``, ``weight [V, H]``, ``input_ids [B, L]`` -> (logprobs, entropy) ``[B, L]``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    bsz, length, width = hidden.shape
    h = hidden[:, :-1].reshape(-1, width)
    tgt = input_ids[:, 1:].reshape(-1)
    lps, ents = [], []
    use_ckpt = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    for start in range(0, h.shape[0], chunk_tokens):
        hc, tc = h[start:start + chunk_tokens], tgt[start:start + chunk_tokens]
        if use_ckpt:
            lp, ent = checkpoint(_chunk_fn, hc, weight, tc, 1.0 / temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_fn(hc, weight, tc, 1.0 / temperature)
        lps.append(lp)
        ents.append(ent)
    zero = torch.zeros(bsz, 1, dtype=torch.float32, device=hidden.device)
    lp_all = torch.cat([zero, torch.cat(lps).view(bsz, length - 1)], dim=1)
    ent_all = torch.cat([zero, torch.cat(ents).view(bsz, length - 1)], dim=1)
    return lp_all, ent_all
