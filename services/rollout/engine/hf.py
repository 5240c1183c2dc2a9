"""The transformers engine: real generation with a KV cache and step-level batching (CPU/tests/demo).

How it works: ``generate`` queues one sequence per sample; a background task runs *steps* in a
single worker thread (torch releases the GIL, so the event loop stays responsive). A step
(1) drops aborted sequences, (2) prefills newly admitted prompts one by one (no padding) and merges
their KV caches into the running batch (left padding + attention mask), (3) runs one batched
decode forward for every active sequence, (4) samples one token per sequence.

Invariants:
- a step holds ``_step_lock`` from the first forward to the last sampled token; ``load_weights``
  takes the same lock, so no forward pass ever mixes old and new weights and every token is
  tagged with the version of the weights that produced it; ``adopt_weights`` swaps the given
  tensors in as ``param.data`` under that lock (no copy) and hands back the replaced storage;
  ``patch_weights`` does the same and also writes delta patches into the served tensors in place,
  under the same lock, after validating every patch (a refused patch changes nothing);
- after a swap, the KV cache of the running sequences is recomputed with the new weights before
  their next token (prompt + tokens generated so far), so a token sampled after a swap depends on
  the new weights only, exactly as if the new weights had produced the whole context;
- the reported log-prob of a token is ``log_softmax(logits / T)[token]`` for ``T = temperature``
  (``T = 1`` when greedy), i.e. under the temperature-scaled distribution *before* top-p
  truncation — exactly what the trainer recomputes from a forward pass with ``logits / T``
  (at the RL temperature 1.0 this equals vLLM's default ``raw_logprobs``);
- stop strings are matched on decoded text; the token that completes a stop string is kept
  (even if the stop string ends inside it); EOS tokens are kept too.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.rollout.engine.base import FinishReason, GenerationChunk, SamplingParams
from services.rollout.engine.requests import check_prompt, stop_loop, stream_samples
from services.rollout.engine.stops import StopMatcher
from services.rollout.engine.weight_spec import WeightSpec


@dataclass(eq=False)  # identity semantics: sequences are looked up in lists
class _Seq:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue[GenerationChunk | BaseException]
    generator: torch.Generator | None
    stops: StopMatcher | None
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed to the model
    n_ctx: int = 0  # tokens already in the KV cache
    aborted: bool = False
    finished: bool = False


@dataclass
class _Out:
    seq: _Seq
    chunk: GenerationChunk


class HFEngine:
    """Engine over a Hugging Face causal LM directory (see ``services.rollout.engine.base``)."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", max_batch_size: int = 64,
                 version: int = 0, device: str = "cpu", torch_threads: int | None = None) -> None:
        # lazy: transformers adds ~5 s of import and only this function needs it
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype))
        self.model.to(device).eval()
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids = self._eos_ids()
        self._version = version
        # state-dict names, tied aliases included (e.g. lm_head.weight -> embed_tokens.weight)
        self._params: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        self._spec = WeightSpec.from_module(self.model)
        self._step_lock = threading.Lock()
        # Intra-op threads of the engine thread only. Small models gain nothing from them, and on busy
        # CPUs OpenMP's barriers make every op wait for a descheduled thread (10x slower decode
        # measured on 2 shared cores), so below SMALL_MODEL_PARAMS the engine runs single-threaded.
        if torch_threads is None and sum(p.numel() for p in self.model.parameters()) < SMALL_MODEL_PARAMS:
            torch_threads = 1
        self.torch_threads = torch_threads
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine",
                                            initializer=_set_threads, initargs=(torch_threads,))
        self._pending: list[_Seq] = []
        self._active: list[_Seq] = []
        self._cache: Any = None
        self._stale_kv = False  # set by a weight swap: the running sequences' KV is recomputed
        self._mask: torch.Tensor | None = None  # (B, L) 1 = real token, 0 = left padding
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[GenerationChunk]:
        if self._closed:
            raise RuntimeError("engine is shut down")
        check_prompt(prompt_ids, self.max_context, self.model.config.vocab_size)
        queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
        seqs = [self._new_seq(prompt_ids, params, request_id, i, queue) for i in range(params.n)]
        self._pending.extend(seqs)
        self._ensure_loop()
        assert self._wakeup is not None
        self._wakeup.set()
        async with aclosing(stream_samples(queue, seqs)) as chunks:  # closed with this generator: aborts
            async for chunk in chunks:
                yield chunk

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._load_sync, named_tensors, version)

    async def shutdown(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        await stop_loop(task, self._pending, self._active)
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ weights
    @property
    def serving_dtype(self) -> str:
        """dtype name of the served floating-point weights (what a delta push must be encoded in)."""
        return str(self.model.dtype).removeprefix("torch.")

    def weight_spec(self) -> WeightSpec:
        """Names, shapes and dtypes a push must match (checked by the weight server before a load)."""
        return self._spec

    def weight_specs(self) -> dict[str, tuple[int, ...]]:
        """Every name ``load_weights`` accepts, with its shape (used to reject a bad push early)."""
        return {name: tuple(t.shape) for name, t in self._params.items()}

    def missing_weights(self, names: Iterable[str]) -> list[str]:
        """Weights of the model that ``names`` leaves unset (a tied alias counts for its target)."""
        covered = {id(self._params[n]) for n in names if n in self._params}
        missing, seen = [], set()
        for name, t in self._params.items():
            if id(t) not in covered and id(t) not in seen:
                missing.append(name)
            seen.add(id(t))
        return missing

    async def adopt_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                            version: int) -> dict[str, torch.Tensor]:
        """``load_weights`` that keeps the given tensors as the new parameters instead of copying them.

        The caller hands them over (it must never write them again). Tensors of the parameter's dtype
        and device, contiguous, become ``param.data``; others are copied. Returns the replaced storage
        of every adopted name (nothing runs on it any more; the caller may reuse it).
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._load_sync, named_tensors, version, True)

    async def patch_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], patches: Iterable[Any],
                            version: int) -> dict[str, torch.Tensor]:
        """``adopt_weights`` plus in-place patches of the served tensors (a delta push).

        Each patch has ``name``, ``validate(tensor)`` (raises ValueError) and ``apply(tensor)``
        (``services.transport.weights.delta.SparsePatch``); all are validated before anything changes.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._load_sync, named_tensors, version, True, list(patches))

    def _load_sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                   adopt: bool = False, patches: list[Any] | None = None) -> dict[str, torch.Tensor]:
        items = list(named_tensors)
        patches = patches or []
        replaced: dict[str, torch.Tensor] = {}
        adopted: set[int] = set()
        for name, tensor in items:  # validate everything before touching anything
            param = self._params.get(name)
            if param is None:
                raise KeyError(f"load_weights: unknown parameter {name!r}")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            if tensor.dtype.is_floating_point != param.dtype.is_floating_point:
                raise ValueError(
                    f"load_weights: {name} has dtype {tensor.dtype}, the model's is {param.dtype}")
        touched = {id(self._params[n]) for n, _ in items}
        for patch in patches:
            param = self._params.get(patch.name)
            if param is None:
                raise KeyError(f"patch_weights: unknown parameter {patch.name!r}")
            if id(param) in touched:
                raise ValueError(f"patch_weights: {patch.name} is both patched and replaced in one push")
            touched.add(id(param))
            patch.validate(param.data)
        with self._step_lock, torch.no_grad():
            for patch in patches:
                patch.apply(self._params[patch.name].data)
            for name, tensor in items:
                param = self._params[name]
                if (adopt and isinstance(param, torch.nn.Parameter) and tensor.dtype == param.dtype
                        and tensor.device == param.device and tensor.is_contiguous()
                        and id(param) not in adopted):  # the second name of a tied pair is copied
                    adopted.add(id(param))
                    replaced[name] = param.data
                    param.data = tensor
                else:
                    _copy_into(param, tensor)
            self._version = version
            self._stale_kv = bool(self._active)
        return replaced

    # ------------------------------------------------------------------ scheduling
    def _new_seq(self, prompt_ids: list[int], params: SamplingParams, request_id: str, index: int,
                 queue: asyncio.Queue[GenerationChunk | BaseException]) -> _Seq:
        gen = None
        if params.temperature > 0:
            gen = torch.Generator()
            seed = params.seed + index if params.seed is not None else int.from_bytes(os.urandom(8), "little")
            gen.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        stops = StopMatcher(self.tokenizer, params.stop) if params.stop else None
        return _Seq(request_id=request_id, index=index, prompt_ids=list(prompt_ids), params=params,
                    queue=queue, generator=gen, stops=stops)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="hf-engine-loop")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            if not self._active and not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            admit: list[_Seq] = []
            room = self.max_batch_size - len(self._active)
            while self._pending and room > 0:
                s = self._pending.pop(0)
                if not s.aborted:
                    admit.append(s)
                    room -= 1
            try:
                outs = await loop.run_in_executor(self._executor, self._step, admit)
            except Exception as exc:  # a failed forward fails every sequence in it, not the engine
                for s in self._active + admit:
                    s.finished = True
                    s.queue.put_nowait(exc)
                self._active, self._cache, self._mask = [], None, None
                continue
            for o in outs:
                if not o.seq.aborted:
                    o.seq.queue.put_nowait(o.chunk)

    # ------------------------------------------------------------------ one step (worker thread)
    def _step(self, admit: list[_Seq]) -> list[_Out]:
        outs: list[_Out] = []
        with self._step_lock, torch.inference_mode():
            version = self._version
            self._drop([s for s in self._active if s.aborted])
            if self._stale_kv:
                self._recompute_kv()
            if self._active:
                seqs = list(self._active)
                outs.extend(self._sample(seqs, self._decode(seqs), version))
                self._drop([s for s in self._active if s.finished])
            groups: dict[int, list[_Seq]] = {}
            for s in admit:  # the n samples of one request share one prefill
                groups.setdefault(id(s.queue), []).append(s)
            for group in groups.values():
                logits = self._prefill(group)
                outs.extend(self._sample(group, logits.expand(len(group), -1), version))
            self._drop([s for s in self._active if s.finished])
        return outs

    def _prefill(self, group: list[_Seq]) -> torch.Tensor:
        # lazy: transformers adds ~5 s of import and only this function needs it
        from transformers import DynamicCache

        prompt = group[0].prompt_ids
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        cache = DynamicCache()
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        if len(group) > 1:
            cache.batch_repeat_interleave(len(group))
        mask = torch.ones(len(group), len(prompt), dtype=torch.long, device=self.device)
        for s in group:
            s.n_ctx = len(prompt)
        self._merge(cache, mask)
        self._active.extend(group)
        return out.logits[:, -1, :].float()

    def _recompute_kv(self) -> None:
        """Rebuild the running batch's KV cache with the current weights (after a swap)."""
        # lazy: transformers adds ~5 s of import and only this function needs it
        from transformers import DynamicCache

        seqs, self._active, self._cache, self._mask = list(self._active), [], None, None
        self._stale_kv = False
        for s in seqs:
            ctx = s.prompt_ids + s.generated[:-1]  # the last sampled token is fed by the next decode
            cache = DynamicCache()
            self.model(input_ids=torch.tensor([ctx], dtype=torch.long, device=self.device),
                       past_key_values=cache, use_cache=True, logits_to_keep=1)
            s.n_ctx = len(ctx)
            self._merge(cache, torch.ones(1, len(ctx), dtype=torch.long, device=self.device))
            self._active.append(s)

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        assert self._mask is not None and len(seqs) == self._mask.shape[0]
        ids = torch.tensor([[s.next_token] for s in seqs], dtype=torch.long, device=self.device)
        pos = torch.tensor([[s.n_ctx] for s in seqs], dtype=torch.long, device=self.device)
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(seqs), 1)], dim=1)
        out = self.model(input_ids=ids, attention_mask=self._mask, position_ids=pos,
                         past_key_values=self._cache, use_cache=True)
        for s in seqs:
            s.n_ctx += 1
        return out.logits[:, -1, :].float()

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor, version: int) -> list[_Out]:
        """One token per row, batched: greedy rows take the argmax; sampled rows draw one uniform
        from their own generator and invert the (top-p filtered) CDF."""
        temps = torch.tensor([[s.params.temperature if s.params.temperature > 0 else 1.0] for s in seqs],
                             dtype=logits.dtype, device=logits.device)
        logp = torch.log_softmax(logits / temps, dim=-1)
        toks = torch.argmax(logits, dim=-1)
        rows = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
        if rows:
            idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
            probs = logp.index_select(0, idx).exp()
            top_p = [seqs[i].params.top_p for i in rows]
            if min(top_p) < 1.0:
                limit = torch.tensor(top_p, dtype=probs.dtype, device=probs.device).unsqueeze(1)
                probs = _top_p_filter(probs, limit)
            u = torch.tensor([float(torch.rand((), generator=seqs[i].generator)) for i in rows],
                             dtype=probs.dtype, device=probs.device).unsqueeze(1)  # CPU generators, GPU math
            cdf = probs.cumsum(dim=-1)
            picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
            toks[idx] = picked.clamp_(max=logits.shape[-1] - 1)
        chosen = logp.gather(1, toks.unsqueeze(1)).squeeze(1).tolist()
        return [_Out(s, self._advance(s, tok, lp, version))
                for s, tok, lp in zip(seqs, toks.tolist(), chosen, strict=True)]

    def _advance(self, s: _Seq, tok: int, logprob: float, version: int) -> GenerationChunk:
        s.generated.append(tok)
        s.next_token = tok
        reason: FinishReason | None = None
        stop_str = None
        if tok in self.eos_token_ids:
            reason = "eos"
        elif s.stops is not None and (stop_str := s.stops.match(s.generated)) is not None:
            reason = "stop"
        elif len(s.generated) >= s.params.max_tokens or s.n_ctx + 1 >= self.max_context:
            reason = "length"
        if reason is not None or s.aborted:
            s.finished = True
        return GenerationChunk(index=s.index, token_ids=[tok], logprobs=[logprob], versions=[version],
                               finished=reason is not None, finish_reason=reason, stop_str=stop_str)

    # ------------------------------------------------------------------ batch KV-cache bookkeeping
    def _merge(self, cache: Any, mask: torch.Tensor) -> None:
        if self._cache is None or self._mask is None or not self._active:
            self._cache, self._mask = cache, mask
            return
        length = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, length), _pad_left(new.keys, length)], dim=0)
            old.values = torch.cat([_pad_left(old.values, length), _pad_left(new.values, length)], dim=0)
        self._mask = torch.cat([_pad_left_2d(self._mask, length), _pad_left_2d(mask, length)], dim=0)

    def _drop(self, gone: list[_Seq]) -> None:
        if not gone:
            return
        keep = [i for i, s in enumerate(self._active) if s not in gone]
        self._select(keep)

    def _select(self, rows: list[int]) -> None:
        if not rows:
            self._active, self._cache, self._mask = [], None, None
            return
        if len(rows) == len(self._active):
            return
        assert self._mask is not None
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self._active = [self._active[i] for i in rows]
        self._cache.batch_select_indices(idx)
        self._mask = self._mask.index_select(0, idx)
        used = torch.nonzero(self._mask.sum(0)).flatten()
        start = int(used[0]) if used.numel() else 0
        if start > 0:  # columns that are padding in every remaining row
            self._mask = self._mask[:, start:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[..., start:, :]
                layer.values = layer.values[..., start:, :]

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        for value in (gen_eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return ids


SMALL_MODEL_PARAMS = 50_000_000


def _set_threads(n: int | None) -> None:
    if n is not None:
        torch.set_num_threads(n)  # per OpenMP thread: the engine thread, not the caller's


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; a plain single-threaded memcpy when both are contiguous CPU tensors of one
    dtype (torch's parallel copy waits on busy cores; a memcpy of warm memory is already fast)."""
    if (dst.dtype == src.dtype and dst.device.type == "cpu" and src.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous() and dst.numel() > 0):
        np.copyto(dst.detach().reshape(-1).view(torch.uint8).numpy(),
                  src.detach().reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, keep the smallest set of most likely tokens whose mass reaches ``top_p`` (>= 1 token)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)


def _pad_left(t: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - t.shape[-2]
    if extra == 0:
        return t
    pad = t.new_zeros(*t.shape[:-2], extra, t.shape[-1])
    return torch.cat([pad, t], dim=-2)


def _pad_left_2d(mask: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - mask.shape[1]
    if extra == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)
