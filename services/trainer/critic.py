"""The critic (value model) for PPO: the policy's Qwen2 backbone plus a linear value head.

Invariants
- Same input layouts as ``Actor``: packed rows (one row, ``attention_mask=None``, ``position_ids``
  restarting at 0 per sequence, per-sequence varlen attention) and padded ``[B, L]`` batches with
  a 2-D mask give the same per-sequence values.
- Values are aligned with tokens exactly like the actor's log-probs: ``out[..., t] = head(h[t-1])``
  is the value of the state *before* token t is emitted (verl's ``values[:, -R-1:-1]``), and
  ``out[..., 0] = 0``. ``step._split_back`` zeroes the cross-boundary position of each packed
  sequence, as it does for log-probs.
- The head is ``hidden -> 1`` with fp32 parameters, and it is computed in fp32: ``fsdp.apply_fsdp2``
  shards the modules listed in ``fp32_units`` as their own units with an fp32 mixed-precision
  policy, whatever ``fsdp.param_dtype`` the backbone uses. Its initialisation depends only on
  ``head_seed`` (normal with the backbone's ``initializer_range``, zero bias), not on global RNG.
- The backbone is stored as ``lm`` and exposes ``decoder_layers`` so that the actor's FSDP helper
  shards it the same way (one unit per decoder layer, root holds embeddings, norm and head).
"""

from __future__ import annotations

import torch
from torch import nn

from services.trainer import varlen_attention


class Critic(nn.Module):
    def __init__(self, backbone: nn.Module, *, head_seed: int = 0, varlen_packed: bool = True) -> None:
        super().__init__()
        self.lm = backbone  # a Qwen2Model (no LM head)
        cfg = backbone.config
        self.value_head = nn.Linear(cfg.hidden_size, 1, dtype=torch.float32)
        gen = torch.Generator().manual_seed(head_seed)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.randn(self.value_head.weight.shape, generator=gen)
                                         * float(getattr(cfg, "initializer_range", 0.02)))
            self.value_head.bias.zero_()
        self.padded_attn = str(cfg._attn_implementation)
        self.packed_attn = varlen_attention.register() if varlen_packed else self.padded_attn

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.lm.layers  # type: ignore[return-value]

    @property
    def fp32_units(self) -> tuple[nn.Module, ...]:
        return (self.value_head,)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, L]`` fp32 values; column t holds V(state before token t), column 0 is 0."""
        self.lm.config._attn_implementation = self.packed_attn if attention_mask is None else self.padded_attn
        hidden = self.lm(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=False).last_hidden_state
        values = self.value_head(hidden[:, :-1].float()).squeeze(-1).float()
        zero = torch.zeros(values.shape[0], 1, dtype=values.dtype, device=values.device)
        return torch.cat([zero, values], dim=1)


def load_critic(model_path: str, *, head_seed: int = 0) -> Critic:
    """A critic whose backbone is loaded from a Hugging Face directory (fp32 master weights)."""
    # lazy: transformers adds ~5 s of import and only this function needs it (PPO only)
    from transformers import AutoModel

    return Critic(AutoModel.from_pretrained(model_path, dtype=torch.float32), head_seed=head_seed)


def build_critic_optimizer(critic: nn.Module, lr: float, betas: tuple[float, float],
                           weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(critic.parameters(), lr=lr, betas=betas, weight_decay=weight_decay,
                             foreach=False)
