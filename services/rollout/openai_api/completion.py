"""One chat-completion turn on the engine: ``n`` choices, as one response or as a chunk stream.

Semantics:
- choice ``i`` is its own engine request (``n = 1``, seed ``seed + i``), exactly as sample ``i`` of
  the agent loop's first turn, so the same prompt and seed give the same tokens on either API;
- the engine's tokens are returned as generated: EOS and the tokens that complete a stop string
  stay in ``token_ids``, while ``content`` is the decoded text (special tokens skipped) cut before a
  stop string, as OpenAI does;
- with tools active, generation pauses at ``</tool_call>`` (the agent loop's hermes stop); a call
  that parses (``agent/toolcall.py``) and names a declared function becomes ``tool_calls`` with
  ``finish_reason: "tool_calls"`` and ``content`` the text before ``<tool_call>`` (``null`` if none);
  a malformed call stays in ``content`` with ``finish_reason: "stop"``;
- streamed ``content`` deltas concatenate to the final ``content``: text that may still turn out to be
  a stop string or a tool call is held back until it cannot.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from services.chat.toolcall import parse_hermes_function
from services.rollout.agent.loop import Tokenizer
from services.rollout.engine.base import Engine, GenerationChunk, SamplingParams
from services.rollout.openai_api.responses import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    Delta,
    FunctionCallOut,
    StreamChoice,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)
from services.rollout.openai_api.textstream import HeldText, IncrementalText

TOOL_OPEN = "<tool_call>"
TOOL_STOP = "</tool_call>"
OpenAIFinish = Literal["stop", "length", "tool_calls"]


class GenerationAborted(RuntimeError):
    """The engine ended a choice without finishing it (aborted or a broken stream)."""


@dataclass
class TurnPlan:
    """Everything one request asks of the engine, validated."""

    model: str
    prompt_ids: list[int]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    stops: list[str]
    tool_names: frozenset[str] | None  # None: tool calls are not parsed
    logprobs: bool
    token_arrays: bool
    include_usage: bool = False
    request_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def params(self, index: int) -> SamplingParams:
        stop = list(self.stops) + ([TOOL_STOP] if self.tool_names is not None else [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            stop=stop,
            seed=None if self.seed is None else self.seed + index,
            n=1,
        )


@dataclass
class Outcome:
    content: str | None
    tool_call: ToolCallOut | None
    finish_reason: OpenAIFinish


def decide(text: str, reason: str | None, stop_str: str | None, tool_names: frozenset[str] | None) -> Outcome:
    """The OpenAI view of a finished choice from its decoded text and the engine's finish."""
    if reason == "stop" and stop_str == TOOL_STOP and tool_names is not None:
        end = text.find(TOOL_STOP)
        turn = text[: end + len(TOOL_STOP)] if end >= 0 else text
        call = parse_hermes_function(turn)
        if call.error is None and call.name in tool_names:
            before = turn[: turn.rfind(TOOL_OPEN, 0, max(end, 0))]
            args = json.dumps(call.arguments, ensure_ascii=False)
            fn = FunctionCallOut(name=call.name or "", arguments=args)
            tool_call = ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}", function=fn)
            return Outcome(before or None, tool_call, "tool_calls")
        return Outcome(turn, None, "stop")
    if reason == "stop" and stop_str:
        at = text.find(stop_str)
        return Outcome(text[:at] if at >= 0 else text, None, "stop")
    if reason == "length":
        return Outcome(text, None, "length")
    if reason in ("eos", "stop"):
        return Outcome(text, None, "stop")
    raise GenerationAborted(f"generation ended with finish reason {reason!r}")


class ChoiceRun:
    """The state of one choice while its tokens arrive."""

    def __init__(self, index: int, plan: TurnPlan, tokenizer: Tokenizer) -> None:
        self.index = index
        self.plan = plan
        self.tokenizer = tokenizer
        self.text = IncrementalText(tokenizer)
        markers = list(plan.stops) + ([TOOL_OPEN, TOOL_STOP] if plan.tool_names is not None else [])
        self.held = HeldText(markers)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.outcome: Outcome | None = None

    def add(self, chunk: GenerationChunk) -> str:
        """Take one engine chunk; return the content that became safe to show."""
        if not (len(chunk.token_ids) == len(chunk.logprobs) == len(chunk.versions)):
            raise RuntimeError("engine returned token ids, log-probs and versions of different lengths")
        self.ids += chunk.token_ids
        self.logprobs += [float(x) for x in chunk.logprobs]
        self.versions += [int(v) for v in chunk.versions]
        shown = self.held.release(self.text.add(list(chunk.token_ids)))
        if chunk.finished:
            shown += self.held.release(self.text.flush())
            self.outcome = decide(self.text.text, chunk.finish_reason, chunk.stop_str, self.plan.tool_names)
        return shown

    def token_logprobs(self, start: int, end: int) -> ChoiceLogprobs:
        entries = []
        for tok, lp in zip(self.ids[start:end], self.logprobs[start:end], strict=True):
            piece = self.tokenizer.decode([tok], skip_special_tokens=False)
            entries.append(TokenLogprob(token=piece, logprob=lp, bytes=list(piece.encode("utf-8"))))
        return ChoiceLogprobs(content=entries)

    def arrays(self, start: int, end: int) -> dict[str, list]:
        if not self.plan.token_arrays:
            return {}
        return {
            "token_ids": self.ids[start:end],
            "token_logprobs": self.logprobs[start:end],
            "token_versions": self.versions[start:end],
        }

    def choice(self) -> Choice:
        out = self.result()
        tool_calls = [out.tool_call] if out.tool_call is not None else None
        return Choice(
            index=self.index,
            message=AssistantMessage(content=out.content, tool_calls=tool_calls),
            logprobs=self.token_logprobs(0, len(self.ids)) if self.plan.logprobs else None,
            finish_reason=out.finish_reason,
            **self.arrays(0, len(self.ids)),
        )

    def result(self) -> Outcome:
        if self.outcome is None:
            raise GenerationAborted("the engine stream ended before the choice finished")
        return self.outcome


async def engine_chunks(engine: Engine, plan: TurnPlan) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """The ``n`` choices' engine streams, merged as they come. Leaving early cancels them all."""
    queue: asyncio.Queue[tuple[int, GenerationChunk] | BaseException | None] = asyncio.Queue()

    async def one(i: int) -> None:
        async for chunk in engine.generate(plan.prompt_ids, plan.params(i), f"{plan.request_id}-{i}"):
            queue.put_nowait((i, chunk))

    async def produce() -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for i in range(plan.n):
                    tg.create_task(one(i))
        except Exception as exc:  # handed to the consumer, which raises it (cancellation propagates)
            queue.put_nowait(exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc)
            return
        queue.put_nowait(None)

    task = asyncio.create_task(produce())
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()  # first, with no await before it: the caller may be in a cancelled scope
        await asyncio.gather(task, return_exceptions=True)


def fingerprint(engine: Engine) -> str:
    return f"retool-policy-v{engine.version}"


async def complete(
    engine: Engine, plan: TurnPlan, tokenizer: Tokenizer, on_tokens: Callable[[int], None]
) -> ChatCompletion:
    runs = [ChoiceRun(i, plan, tokenizer) for i in range(plan.n)]
    async for i, chunk in engine_chunks(engine, plan):
        runs[i].add(chunk)
        on_tokens(len(chunk.token_ids))
    choices = [r.choice() for r in runs]
    return ChatCompletion(
        id=plan.request_id,
        created=plan.created,
        model=plan.model,
        system_fingerprint=fingerprint(engine),
        choices=choices,
        usage=_usage(plan, runs),
        prompt_token_ids=plan.prompt_ids if plan.token_arrays else None,
    )


async def stream(
    engine: Engine, plan: TurnPlan, tokenizer: Tokenizer, on_tokens: Callable[[int], None]
) -> AsyncIterator[ChatCompletionChunk]:
    """Chunks: one role delta per choice (the first carries ``prompt_token_ids``), then per engine
    chunk the released content, tokens and log-probs; the last chunk of a choice carries the rest
    of its content, its tool call and ``finish_reason``; then usage if asked for."""
    runs = [ChoiceRun(i, plan, tokenizer) for i in range(plan.n)]

    def chunk(choices: list[StreamChoice], **extra: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=plan.request_id,
            created=plan.created,
            model=plan.model,
            system_fingerprint=fingerprint(engine),
            choices=choices,
            **extra,  # type: ignore[arg-type]
        )

    for i in range(plan.n):
        first = StreamChoice(index=i, delta=Delta(role="assistant", content=""))
        ids = plan.prompt_ids if plan.token_arrays and i == 0 else None
        yield chunk([first], prompt_token_ids=ids)
    async for i, part in engine_chunks(engine, plan):
        run = runs[i]
        start = len(run.ids)
        shown = run.add(part)
        on_tokens(len(part.token_ids))
        end = len(run.ids)
        delta = Delta(content=shown or None)
        finish: OpenAIFinish | None = None
        if part.finished:
            out = run.result()
            rest = run.held.rest(out.content or "")
            delta.content = (shown + rest) or None
            if out.tool_call is not None:
                call = out.tool_call
                delta.tool_calls = [ToolCallDelta(index=0, id=call.id, function=call.function)]
            finish = out.finish_reason
        has_tokens = end > start and (plan.token_arrays or plan.logprobs)
        if delta.content is None and finish is None and not has_tokens:
            continue
        yield chunk(
            [
                StreamChoice(
                    index=i,
                    delta=delta,
                    logprobs=run.token_logprobs(start, end) if plan.logprobs else None,
                    finish_reason=finish,
                    **run.arrays(start, end),
                )
            ]
        )
    if plan.include_usage:
        yield chunk([], usage=_usage(plan, runs))


def _usage(plan: TurnPlan, runs: list[ChoiceRun]) -> Usage:
    prompt, generated = len(plan.prompt_ids), sum(len(r.ids) for r in runs)
    return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)
