"""What every in-process engine does with one ``generate`` request, apart from generating: refuse a
prompt it cannot serve, and hand the request's ``n`` samples back from one queue.

Invariants: a prompt is refused with a ``ValueError`` naming ``prompt_ids`` before anything is queued;
``stream_samples`` yields every chunk of the request in order, re-raises an exception the engine put
on the queue, stops after the ``n``-th finished sample, and marks every sample that has not finished
``aborted`` when the caller stops reading (so the engine drops it at its next step).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from services.rollout.engine.base import GenerationChunk


class Sample(Protocol):
    finished: bool
    aborted: bool


def check_prompt(prompt_ids: list[int], max_context: int, vocab_size: int) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids: must not be empty")
    if len(prompt_ids) >= max_context:
        raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens exceed the context of {max_context}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt_ids: token ids must be in [0, {vocab_size})")


async def stream_samples(queue: asyncio.Queue[GenerationChunk | BaseException],
                         samples: Sequence[Sample]) -> AsyncIterator[GenerationChunk]:
    remaining = len(samples)
    try:
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield item
    finally:
        for s in samples:
            if not s.finished:
                s.aborted = True


async def stop_loop(task: asyncio.Task[None] | None, *queued: list[Any]) -> None:
    """Shut down: cancel the engine's step loop, then fail every sample still waiting or running
    ("engine shut down") and empty those lists."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    for samples in queued:
        for s in samples:
            s.queue.put_nowait(RuntimeError("engine shut down"))
        samples.clear()
