"""The actor module: a causal LM whose forward returns per-token log-probs and entropy.

Invariant: the whole computation (decoder + chunked LM head) runs inside this module's forward,
so FSDP2 (root ``fully_shard`` on this module) has every parameter unsharded exactly when it is
used. Packed inputs pass ``attention_mask=None`` and per-sequence ``position_ids`` (their sequence
boundaries are found once per forward, see ``varlen_attention``); padded inputs pass a 2-D attention
mask.
"""

from __future__ import annotations

import torch
from torch import nn

from services.trainer import varlen_attention
from services.trainer.logprobs import token_logprobs


class Actor(nn.Module):
    def __init__(self, lm: nn.Module, *, chunk_tokens: int = 4096, temperature: float = 1.0,
                 varlen_packed: bool = True, varlen_backend: str | None = None, entropy: bool = True) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.temperature = temperature
        self.entropy = entropy  # False: the entropy output is all 0 and not computed (SFT)
        self.padded_attn = str(lm.config._attn_implementation)
        self.packed_attn = varlen_attention.register() if varlen_packed else self.padded_attn
        self.varlen_backend = varlen_backend  # None: varlen_attention.backend_for (a benchmark pins one)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.lm.model.layers  # type: ignore[return-value]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy) ``[B, L]``; with ``positions`` (e.g. the loss mask) only those positions
        go through the LM head and the others are 0 (``token_logprobs``)."""
        # packed rows (no 2-D mask) use per-sequence attention; padded batches use the model's own
        packed = attention_mask is None
        self.lm.config._attn_implementation = self.packed_attn if packed else self.padded_attn
        extra = {}
        if packed and self.packed_attn == varlen_attention.NAME and input_ids.shape[0] == 1:
            # the sequence boundaries once per forward (one host sync), not once per layer
            seg = varlen_attention.segments_of(position_ids, self.varlen_backend)
            extra[varlen_attention.SEGMENTS_KWARG] = seg
        out = self.lm.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=False, **extra)
        hidden = out.last_hidden_state
        return token_logprobs(hidden, self.lm.lm_head.weight, input_ids, temperature=self.temperature,
                              chunk_tokens=self.chunk_tokens, positions=positions, entropy=self.entropy)


def tiny_qwen2(*, hidden: int = 64, layers: int = 2, vocab: int = 256, heads: int = 4, kv_heads: int = 2,
               seed: int = 0, attn_implementation: str = "sdpa", max_positions: int = 4096) -> nn.Module:
    """A randomly initialised tiny Qwen2 causal LM (for tests and benchmarks; nothing downloaded)."""
    # lazy: transformers adds ~5 s of import and only this function needs it
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=False)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    return model.float()
