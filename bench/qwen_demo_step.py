"""What one ``retool demo`` step would cost with the real Qwen2.5 vocabulary (issue 35, item 4).

The ``demo`` preset (hidden 128, 3 layers, tied embeddings) with 151,936 rows against the same model
with the demo's own 512-row vocabulary, in one process and one after the other, so the ratio says
more than the seconds on a shared machine. Shapes are the demo's with the Qwen2.5-Instruct template
(its default system prompt makes a prompt 41 tokens; a code-using SFT trace is 95):

- SFT step: 32 traces of 95 tokens, packed, forward + backward + AdamW (``train_step`` without the
  old-log-prob pass; the SFT loss differs but costs the same);
- GRPO trainer step: 64 samples of 95 tokens: old-log-prob recompute, then forward + backward + AdamW;
- rollout: 64 sequences decoding 48 tokens with a KV cache, sampling from the full softmax (the
  transformers engine's per-token work: LM head, ``log_softmax``, ``multinomial``).

    PYTHONPATH=$PWD .venv/bin/python bench/qwen_demo_step.py
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def demo_model(vocab: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float()


def step_seconds(vocab: int, n_samples: int, length: int, recompute: bool, chunk: int) -> float:
    from services.trainer.actor import Actor
    from services.trainer.packing import TrainSample
    from services.trainer.step import StepSettings, train_step

    actor = Actor(demo_model(vocab), chunk_tokens=chunk)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(n_samples):
        ids = torch.randint(0, min(vocab, 151643), (length,), generator=g)
        mask = torch.zeros(length)
        mask[41:] = 1
        adv = mask * torch.randn(1, generator=g)
        samples.append(TrainSample(input_ids=ids, loss_mask=mask, advantages=adv,
                                   rollout_logprobs=-torch.rand(length, generator=g)))
    settings = StepSettings(mini_batch_size=n_samples, micro_batch_max_tokens=n_samples * length,
                            recompute_old_logprobs=recompute)
    t0 = time.perf_counter()
    train_step(actor, opt, samples, settings)
    return time.perf_counter() - t0


@torch.no_grad()
def rollout_seconds(vocab: int, batch: int, prompt: int, new_tokens: int) -> float:
    from transformers import DynamicCache

    lm = demo_model(vocab).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, 151643), (batch, prompt), generator=g)
    t0 = time.perf_counter()
    cache = DynamicCache()
    out = lm(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    for _ in range(new_tokens):
        logp = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=g)
        out = lm(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the demo's default (torch_threads: 1)
    result: dict[str, Any] = {}
    for vocab in (512, 151936):
        r = {"sft_step_s": step_seconds(vocab, 32, 95, False, args.chunk_tokens),
             "grpo_train_step_s": step_seconds(vocab, 64, 95, True, args.chunk_tokens),
             "rollout_64x48_s": rollout_seconds(vocab, 64, 41, 48)}
        result[str(vocab)] = r
        print(vocab, json.dumps({k: round(v, 2) for k, v in r.items()}), flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
