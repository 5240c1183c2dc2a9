"""The engine contract every generation backend (transformers, vLLM) implements.

Invariants:
- token ids in, token ids out; nothing is re-tokenized;
- every generated token comes with the log-prob of the sampled token under the policy that
  produced it, and that policy's version. The log-prob is ``log_softmax(logits / T)[token]``
  (``T = 1`` when greedy): temperature-scaled, before top-p truncation; at T = 1 (RL rollouts)
  it is the plain model log-prob the trainer recomputes;
- EOS tokens are kept in ``token_ids`` (``finish_reason == "eos"``);
- when a stop string is hit, the tokens that complete it are kept and generation ends with
  ``finish_reason == "stop"`` and ``stop_str`` set;
- ``load_weights`` is atomic from the caller's point of view: tokens are produced either by
  the old weights or by the complete new ones, never by a mix inside one forward pass.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, Field

FinishReason = Literal["stop", "eos", "length", "abort"]


class SamplingParams(BaseModel):
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(1024, ge=1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    n: int = Field(1, ge=1, description="independent samples of the same prompt")


@dataclass
class GenerationChunk:
    """Tokens produced since the previous chunk of one sequence (``index`` among the ``n``)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_str: str | None = None


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_str: str | None = None


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int: ...

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[GenerationChunk]:
        """Stream chunks for ``params.n`` sequences; each sequence ends with a ``finished`` chunk."""
        ...

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Swap in the given weights (all of them, atomically) and set ``version``."""
        ...

    async def shutdown(self) -> None: ...


def engine_error(engine: object) -> str | None:
    """Why ``engine`` cannot serve (``health_error()`` of engines that can tell, e.g. a dead vLLM engine
    core), or None when it can."""
    probe = getattr(engine, "health_error", None)
    if not callable(probe):
        return None
    try:
        return probe()
    except Exception as exc:  # a probe that fails is itself a reason not to serve
        return f"engine health check failed: {exc!r}"


async def collect(engine: Engine, prompt_ids: list[int], params: SamplingParams,
                  request_id: str) -> list[GenerationResult]:
    """Run ``generate`` to completion and gather one result per sample."""
    results = [GenerationResult() for _ in range(params.n)]
    async for chunk in engine.generate(prompt_ids, params, request_id):
        res = results[chunk.index]
        res.token_ids.extend(chunk.token_ids)
        res.logprobs.extend(chunk.logprobs)
        res.versions.extend(chunk.versions)
        if chunk.finished:
            res.finish_reason = chunk.finish_reason
            res.stop_str = chunk.stop_str
    return results
