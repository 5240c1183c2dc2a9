"""``engine: synthetic``: an engine with no model that writes ReTool-shaped turns at a modelled speed.

It implements the engine contract (``services/rollout/engine/base.py``) in full, so the rollout
service, its agent loop, the sandbox, the reward service, Redis and the trainer run for real around
it, at GPU token rates this machine cannot reach with a real model:
- what it writes: ``synthetic_script.py`` (reasoning, ``<code>`` blocks of real Python, answers);
- log-probs: ``synthetic_logprob(fingerprint, token, position)``, a pure function of the served
  weights' fingerprint, so tokens are attributable to the weights that produced them;
- when: ``synthetic_config.py`` (a step of all running sequences costs a modelled time; ``infinite``:
  none, the event loop only yields between steps);
- weights: the model directory's weight set, or with ``payload_mb`` a synthetic one
  (``synthetic_payload.py``); ``load_weights`` checks a push with ``WeightSpec`` (a bad push changes
  nothing) and swaps fingerprint and version between two steps (atomic: no step sees a mix);
- stops: the real ``StopMatcher`` (a stop string ending inside a token keeps that token), run only on
  tokens whose text holds the last character of some stop when all stops end in ASCII (a stop is
  completed by a token holding its last byte); EOS ids in ``eos_token_ids`` are kept; ``length`` at
  ``max_tokens``;
- sampling: greedy ignores seeds; a seeded request draws from ``(engine seed, seed + i, fingerprint,
  context)``; an unseeded one from the engine's own seeded stream: a run is reproducible from
  ``seed`` and the order of requests.
Counters (tokens, steps, busy and idle time, prefill tokens, the engine's own CPU time) go to
``stats_path`` as JSON every second and at shutdown.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from services.rollout.engine.base import FinishReason, GenerationChunk, SamplingParams
from services.rollout.engine.requests import check_prompt, stop_loop, stream_samples
from services.rollout.engine.stops import StopMatcher
from services.rollout.engine.synthetic_config import SyntheticEngineConfig, step_seconds
from services.rollout.engine.synthetic_payload import fingerprint, payload_spec
from services.rollout.engine.synthetic_script import Script, synthetic_logprob
from services.rollout.engine.weight_spec import WeightSpec


@dataclass(eq=False)
class _Seq:
    index: int
    context_len: int
    params: SamplingParams
    queue: asyncio.Queue[GenerationChunk | BaseException]
    rng: random.Random
    script: list[int]
    stops: StopMatcher | None
    stop_ends: str | None  # last characters of the stops, all ASCII; None: check every token
    generated: list[int] = field(default_factory=list)
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    out_vers: list[int] = field(default_factory=list)
    prefilled: bool = False
    finished: bool = False
    aborted: bool = False


@dataclass
class EngineStats:
    requests: int = 0
    sequences: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0  # modelled step time (or, for infinite, the real time of the steps)
    idle_s: float = 0.0  # between the first request and now, no sequence running
    engine_cpu_s: float = 0.0  # CPU time of the engine's own step work in this process
    pushes: int = 0
    first_request_at: float | None = None
    max_running: int = 0


class SyntheticEngine:
    """See the module docstring."""

    def __init__(self, model_dir: str | Path, *, version: int = 0, **engine_kwargs: Any) -> None:
        # lazy: transformers adds ~5 s of import and only this function needs it
        from transformers import AutoTokenizer

        self.cfg = SyntheticEngineConfig.parse(engine_kwargs)
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.vocab_size = len(self.tokenizer)
        self.max_context = self.cfg.max_model_len
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids: set[int] = {int(eos)} if isinstance(eos, int) else set()
        self._script = Script(self.tokenizer, self.cfg, next(iter(self.eos_token_ids), None))
        if self.cfg.payload_mb is not None:
            self._spec = payload_spec(self.cfg.payload_mb)
            self._fingerprint = 0
        else:
            self._spec = WeightSpec.from_model_dir(self.model_dir)
            self._fingerprint = fingerprint(self._spec.check(_model_dir_tensors(self.model_dir)))
        self._version = version
        self._timing = self.cfg.timing()
        self._rng = random.Random(self.cfg.seed)
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._context_tokens = 0  # of the running sequences
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.stats = EngineStats()
        self._stats_written = 0.0
        self._stop_verdicts: dict[str, dict[int, bool]] = {}  # last chars -> token id -> may complete

    # ------------------------------------------------------------------ contract
    @property
    def version(self) -> int:
        return self._version

    @property
    def serving_dtype(self) -> str:
        return "float32"

    def weight_spec(self) -> WeightSpec:
        return self._spec

    def weight_specs(self) -> dict[str, tuple[int, ...]]:
        return self._spec.shapes()

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[GenerationChunk]:
        if self._closed:
            raise RuntimeError("engine is shut down")
        check_prompt(prompt_ids, self.max_context, self.vocab_size)
        queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
        seqs = [self._new_seq(prompt_ids, params, i, queue) for i in range(params.n)]
        self.stats.requests += 1
        self.stats.sequences += len(seqs)
        if self.stats.first_request_at is None:
            self.stats.first_request_at = time.monotonic()
        self._waiting.extend(seqs)
        self._ensure_loop()
        assert self._wakeup is not None
        self._wakeup.set()
        async with aclosing(stream_samples(queue, seqs)) as chunks:  # closed with this generator: aborts
            async for chunk in chunks:
                yield chunk

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Check the push against the served weight set, then swap fingerprint and version at once
        (between two engine steps: this runs on the event loop the steps run on)."""
        tensors = self._spec.check(list(named_tensors), complete=True)
        digest = await asyncio.get_running_loop().run_in_executor(None, fingerprint, tensors)
        self._fingerprint, self._version = digest, version
        self.stats.pushes += 1

    async def shutdown(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        await stop_loop(task, self._waiting, self._running)
        self._write_stats(force=True)

    # ------------------------------------------------------------------ sequences
    def _new_seq(self, prompt_ids: list[int], params: SamplingParams, index: int,
                 queue: asyncio.Queue[GenerationChunk | BaseException]) -> _Seq:
        if params.temperature == 0:
            key: tuple[int, ...] = (0, self.cfg.seed, self._fingerprint)  # ints only: hash() is stable
        elif params.seed is not None:
            key = (1, self.cfg.seed, params.seed + index, self._fingerprint)
        else:
            key = (2, self._rng.getrandbits(64))
        rng = random.Random(hash((key, len(prompt_ids), tuple(prompt_ids[-16:]))))
        stops = StopMatcher(self.tokenizer, params.stop) if params.stop else None
        ends = "".join(sorted({x[-1] for x in params.stop if x}))
        return _Seq(index=index, context_len=len(prompt_ids), params=params, queue=queue, rng=rng,
                    script=self._script.turn(prompt_ids, rng), stops=stops,
                    stop_ends=ends if ends.isascii() else None)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    # ------------------------------------------------------------------ the step loop
    async def _run(self) -> None:
        assert self._wakeup is not None
        infinite = self.cfg.preset == "infinite"
        idle_since: float | None = None
        while not self._closed:
            if not self._running and not self._waiting:
                idle_since = time.monotonic()
                self._write_stats()
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=1.0)
                except TimeoutError:
                    continue
                finally:
                    self.stats.idle_s += time.monotonic() - idle_since
                continue
            start = time.monotonic()
            cpu = time.thread_time()
            prefill = self._admit()
            delay = step_seconds(self._timing, len(self._running), self._context_tokens, prefill)
            self._step()
            self.stats.engine_cpu_s += time.thread_time() - cpu
            if infinite:
                await asyncio.sleep(0)
                self.stats.busy_s += time.monotonic() - start
            else:
                await asyncio.sleep(max(0.0, start + delay - time.monotonic()))
                self.stats.busy_s += delay
            self._write_stats()

    def _admit(self) -> int:
        prefill = 0
        room = self.cfg.max_num_seqs - len(self._running)
        while self._waiting and room > 0:
            s = self._waiting.pop(0)
            if s.aborted:
                continue
            self._running.append(s)
            self._context_tokens += s.context_len
            prefill += s.context_len  # no prefix cache modelled for the prompt: an upper bound
            room -= 1
        self.stats.prefill_tokens += prefill
        self.stats.max_running = max(self.stats.max_running, len(self._running))
        return prefill

    def _step(self) -> None:
        """Every running sequence writes one token."""
        version, fp, eos = self._version, self._fingerprint, self.eos_token_ids
        interval = self.cfg.stream_interval
        done: list[_Seq] = []
        for s in self._running:
            if s.aborted:
                done.append(s)
                continue
            n = len(s.generated)
            if n >= len(s.script):
                s.script += self._script.filler(s.rng, 64)
            tok = s.script[n]
            s.generated.append(tok)
            s.out_ids.append(tok)
            s.out_lps.append(synthetic_logprob(fp, tok, s.context_len + n))
            s.out_vers.append(version)
            reason: FinishReason | None = None
            stop_str = None
            if tok in eos:
                reason = "eos"
            elif s.stops is not None and self._may_stop(tok, s) and (stop_str := s.stops.match(s.generated)):
                reason = "stop"
            elif n + 1 >= s.params.max_tokens or s.context_len + n + 1 >= self.max_context:
                reason = "length"
            if reason is not None:
                self._emit(s, reason, stop_str)
                done.append(s)
            elif len(s.out_ids) >= interval:
                self._emit(s, None, None)
        self.stats.tokens += len(self._running)
        self.stats.steps += 1
        self._context_tokens += len(self._running)
        for s in done:
            self._running.remove(s)
            self._context_tokens -= s.context_len + len(s.generated)

    def _may_stop(self, tok: int, s: _Seq) -> bool:
        """False only when ``tok`` cannot complete any of ``s``'s (all-ASCII) stop strings (one dict
        lookup per token: the verdict per token id is cached per set of last characters)."""
        ends = s.stop_ends
        if ends is None:
            return True
        verdicts = self._stop_verdicts.get(ends)
        if verdicts is None:
            verdicts = self._stop_verdicts[ends] = {}
        verdict = verdicts.get(tok)
        if verdict is None:
            piece = self.tokenizer.decode([tok])
            verdict = verdicts[tok] = any(c in piece for c in ends)
        return verdict

    def _emit(self, s: _Seq, reason: FinishReason | None, stop_str: str | None) -> None:
        chunk = GenerationChunk(index=s.index, token_ids=s.out_ids, logprobs=s.out_lps, versions=s.out_vers,
                                finished=reason is not None, finish_reason=reason, stop_str=stop_str)
        s.out_ids, s.out_lps, s.out_vers = [], [], []
        if reason is not None:
            s.finished = True
        s.queue.put_nowait(chunk)

    # ------------------------------------------------------------------ counters
    def _write_stats(self, force: bool = False) -> None:
        if self.cfg.stats_path is None:
            return
        now = time.monotonic()
        if not force and now - self._stats_written < 1.0:
            return
        self._stats_written = now
        data = dict(self.stats.__dict__)
        data.update(span_s=0.0 if self.stats.first_request_at is None else now - self.stats.first_request_at,
                    preset=self.cfg.preset, version=self._version, pid=os.getpid(), time=time.time())
        tmp = Path(f"{self.cfg.stats_path}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.cfg.stats_path)


def _model_dir_tensors(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return list(tensors.items())
