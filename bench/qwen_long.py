"""Real lengths with the real Qwen2.5 vocabulary (151,936 rows): a multi-turn rollout and a trainer
step with long responses, at several lengths in one run so their ratios show the scaling.

- rollout: the agent loop (services/rollout/agent/loop.py) with the real tokenizer, 8 tool turns
  whose tokens are replayed one at a time by ``Replay`` below, which checks stops with the engines'
  own ``StopMatcher`` after every token (no model: this times *our* per-token work: stop matching,
  chunk bookkeeping, tool-result tokenization, prompt re-assembly per turn), interpreter outputs of
  ~60 tokens; response lengths 2k..16k tokens. Quadratic work shows as time/token growing with
  length. (The agent tests' ScriptedEngine decodes the whole turn at every token, quadratic in the
  turn: it is not used here.)
- trainer: one ``train_step`` (fwd + bwd + AdamW) of the ``mini`` Qwen2 model with untied 151,936-row
  embeddings on one sample of prompt 256 + response L (loss mask 1 on the response), packed,
  log-probs over the full vocabulary in chunks (``Actor(chunk_tokens)``). Each length runs in a
  fresh subprocess (``--trainer-child``), so its peak RSS (the process's high-water mark) is that
  length's alone; ``base_rss_gib`` is the child's high-water mark before the step (model, optimizer,
  interpreter). ``--head checkpointed`` swaps in the LM head of before the fused one (autograd's
  log-softmax/softmax per chunk under ``torch.utils.checkpoint``), for before/after figures.

    PYTHONPATH=$PWD .venv/bin/python bench/qwen_long.py                 # 4k, 16k trainer; 2k..16k rollout
    PYTHONPATH=$PWD .venv/bin/python bench/qwen_long.py --quick         # 1k, 4k
    PYTHONPATH=$PWD .venv/bin/python bench/qwen_long.py --skip-rollout --trainer-lengths 4096 \
        --head checkpointed                                              # one trainer length, the old head
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Replay:
    """Engine protocol: each call streams the next scripted turn, one token per chunk, ending at the
    first stop string (StopMatcher, as the HF engine) or EOS."""

    def __init__(self, tok: Any, turns: list[list[int]]) -> None:
        self.tokenizer, self.turns, self.version = tok, list(turns), 0

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        from services.rollout.engine.base import GenerationChunk
        from services.rollout.engine.stops import StopMatcher

        matcher = StopMatcher(self.tokenizer, list(params.stop))
        out: list[int] = []
        for tid in self.turns.pop(0):
            out.append(tid)
            stop = matcher.match(out)
            eos = tid == self.tokenizer.eos_token_id
            done = stop is not None or eos or len(out) >= params.max_tokens
            reason = "stop" if stop else "eos" if eos else "length" if done else None
            yield GenerationChunk(index=0, token_ids=[tid], logprobs=[-1.0], versions=[0], finished=done,
                                  finish_reason=reason, stop_str=stop)
            if done:
                return


class FixedOutput:
    async def run(self, code: str) -> Any:
        from services.rollout.agent.sandbox import ToolResult

        return ToolResult("Traceback (most recent call last):\n  ValueError: 数学 😀 "
                          + "1234567890" * 8, True)


async def rollout_once(tok: Any, response_tokens: int, turns: int) -> dict[str, float]:
    from services.rollout.agent.loop import AgentLoop
    from services.rollout.config import AgentConfig

    per_turn = response_tokens // (turns + 1) - 80
    body = tok.encode("Let x = 6*7 and 数学 😀 $\\frac{a}{b}$; " * 2000, add_special_tokens=False)[:per_turn]
    close = tok.encode("\n```\n</code>\n\n", add_special_tokens=False)
    script: list[Any] = [body + close for _ in range(turns)] + [body + [tok.eos_token_id]]
    cfg = AgentConfig(max_turns=turns, max_response_tokens=response_tokens + 4096)
    loop = AgentLoop(Replay(tok, script), tok, FixedOutput(), cfg)  # type: ignore[arg-type]
    prompt = loop.build_prompt([{"role": "user", "content": "Compute with code."}])
    t0 = time.perf_counter()
    traj = await loop.run_one(prompt)
    dt = time.perf_counter() - t0
    assert traj.tool_calls == turns and traj.finish_reason == "eos", (traj.tool_calls, traj.finish_reason)
    n = len(traj.response_ids)
    return {"response_tokens": n, "seconds": dt, "us_per_token": 1e6 * dt / n}


def checkpointed_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, *,
                                temperature: float = 1.0, chunk_tokens: int = 4096
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head before the fused one (commit 6449e01): autograd's ops per chunk, checkpointed."""
    from torch.utils.checkpoint import checkpoint

    def chunk_fn(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, inv: float) -> tuple[torch.Tensor, ...]:
        logits = torch.nn.functional.linear(h, w).float()
        if inv != 1.0:
            logits = logits * inv
        lse = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - lse
        return lp, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)

    bsz, length, width = hidden.shape
    h, tgt = hidden[:, :-1].reshape(-1, width), input_ids[:, 1:].reshape(-1)
    lps, ents = [], []
    for s in range(0, h.shape[0], chunk_tokens):
        e = s + chunk_tokens
        lp, ent = checkpoint(chunk_fn, h[s:e], weight, tgt[s:e], 1.0 / temperature, use_reentrant=False)
        lps.append(lp)
        ents.append(ent)
    zero = torch.zeros(bsz, 1)
    return (torch.cat([zero, torch.cat(lps).view(bsz, -1)], 1),
            torch.cat([zero, torch.cat(ents).view(bsz, -1)], 1))


def trainer_once(model_dir: Path, response_tokens: int, chunk_tokens: int, head: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from services.trainer import actor as actor_mod
    from services.trainer.actor import Actor
    from services.trainer.packing import TrainSample
    from services.trainer.step import StepSettings, train_step

    if head == "checkpointed":
        actor_mod.token_logprobs = checkpointed_token_logprobs  # type: ignore[assignment]
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    actor = Actor(lm, chunk_tokens=chunk_tokens)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    n = 256 + response_tokens
    ids = torch.randint(0, 151643, (n,), generator=g)
    mask = torch.zeros(n)
    mask[256:] = 1
    sample = TrainSample(input_ids=ids, loss_mask=mask, advantages=mask * 1.0,
                         rollout_logprobs=-torch.rand(n, generator=g) * 12)
    settings = StepSettings(mini_batch_size=1, micro_batch_max_tokens=n, use_packing=True,
                            recompute_old_logprobs=False)
    base = rss_gib()
    t0 = time.perf_counter()
    metrics = train_step(actor, opt, [sample], settings)
    return {"tokens": n, "head": head, "chunk_tokens": chunk_tokens, "seconds": time.perf_counter() - t0,
            "peak_rss_gib": rss_gib(), "base_rss_gib": base, "pg_loss": metrics["actor/pg_loss"],
            "grad_norm": metrics["actor/grad_norm"]}


def trainer_in_subprocess(model_dir: Path, response_tokens: int, chunk_tokens: int, head: str
                          ) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--trainer-child", str(model_dir), str(response_tokens),
                          "--chunk-tokens", str(chunk_tokens), "--head", head],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="Actor: logits rows materialised at once")
    ap.add_argument("--head", choices=["fused", "checkpointed"], default="fused",
                    help="LM head + log-softmax: the trainer's (fused) or the one before it (checkpointed)")
    ap.add_argument("--trainer-lengths", type=int, nargs="*", default=None, help="response tokens per step")
    ap.add_argument("--skip-trainer", action="store_true")
    ap.add_argument("--skip-rollout", action="store_true")
    ap.add_argument("--trainer-child", nargs=2, metavar=("MODEL_DIR", "RESPONSE_TOKENS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.trainer_child:
        model_dir, length = Path(args.trainer_child[0]), int(args.trainer_child[1])
        print(json.dumps(trainer_once(model_dir, length, args.chunk_tokens, args.head)))
        return
    from transformers import AutoTokenizer

    from services.models.tiny import init_model_dir

    result: dict[str, Any] = {"vocab_rows": 151936, "turns": args.turns, "rollout": [], "trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model_dir(Path(tmp) / "m", "mini", tokenizer="qwen2.5")
        if not args.skip_rollout:
            tok = AutoTokenizer.from_pretrained(str(model_dir))
            for n in [1024, 4096] if args.quick else [2048, 4096, 8192, 16384]:
                r = asyncio.run(rollout_once(tok, n, args.turns))
                result["rollout"].append(r)
                print(f"rollout  {r['response_tokens']:6d} tokens, {args.turns} turns: {r['seconds']:.2f} s, "
                      f"{r['us_per_token']:.1f} us/token", flush=True)
            ro = result["rollout"]
            ratio = ro[-1]["us_per_token"] / ro[0]["us_per_token"]
            result["rollout_us_per_token_ratio_longest_to_shortest"] = ratio
        if not args.skip_trainer:
            lengths = args.trainer_lengths or ([1024, 4096] if args.quick else [4096, 16384])
            for n in lengths:
                t = trainer_in_subprocess(model_dir, n, args.chunk_tokens, args.head)
                result["trainer"].append(t)
                print(f"trainer  {t['tokens']:6d} tokens ({t['head']} head, chunks of {t['chunk_tokens']}): "
                      f"{t['seconds']:.1f} s/step, peak RSS {t['peak_rss_gib']:.2f} GiB "
                      f"(before the step {t['base_rss_gib']:.2f})", flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
