"""The multi-turn tool loop: generate, pause at the tool stop string, run the code, append, continue.

Semantics (one response = one trajectory):
- the prompt is chat-templated once (``tokenizer.apply_chat_template(..., add_generation_prompt=True)``
  as text, then encoded without extra special tokens); the trainer may also send prompt ids;
- each turn generates from ``prompt_ids + response_ids`` with stop strings ``[tool_stop]``
  (``</code>`` or ``</tool_call>``) plus ``</answer>`` when ``stop_at_answer``; the model's tokens are
  appended exactly as generated (never re-tokenized), loss mask 1, with their log-probs and the
  policy version that produced each;
- on the tool stop the call is parsed (``toolcall.py``); a valid call runs in the sandbox; the
  output (or the error text, for malformed calls and sandbox failures) is cut in the middle to
  ``max_tool_output_chars``, put into ``result_template`` (code format:
  ``"\\n<interpreter>\\n{output}\\n</interpreter>\\n"``,
  hermes: ``"\\n<tool_response>\\n{output}\\n</tool_response>\\n"``),
  tokenized on its own (``tool_result_ids``: special-token text in the output stays plain text)
  and appended with loss mask 0, log-prob 0.0 and version -1;
- the response ends at EOS (``eos``), at a generated ``</answer>`` (``answer``), when the model asks
  for tool call number ``max_turns + 1`` (``max_turns``; that request is not run), or when the
  ``max_response_tokens`` budget of generated + interpreter tokens is used up (``length``,
  ``truncated=True``; an interpreter block that does not fit is cut to the budget); the budget is
  also capped by the engine's context (``engine.max_context - 1 - len(prompt)``) when it has one;
- with ``tool_session: persistent`` the calls of one response run in one live sandbox session,
  opened at its first call and closed when the response ends (also on error or cancellation);
- with ``sampling.seed`` set, sample ``i`` turn ``t`` uses seed ``seed + i + 1_000_003 * t``; a turn
  continued from a mid-turn checkpoint is asked for again with its turn's seed (on a longer
  context: a fresh draw of the rest, not a replay of the tokens lost);
- with ``checkpoints`` (the Redis worker), the state is checkpointed at each turn boundary (after
  the interpreter's output was appended), after a weight swap within a turn, and when the response
  ends (``checkpoint.py``). A swap is a chunk holding a version newer than the turn's previous
  generated token (versions never decrease within a stream); its checkpoint is taken at the end of
  that chunk, or of the first later one whose turn text so far does not end with a proper prefix
  of a stop string or an incomplete character (``splits_a_stop``: the continuation's stop matcher
  sees only its own tokens), and not at all when the turn ends first (its boundary or final
  checkpoint follows). A mid-turn checkpoint records its open turn's start, so the sample that
  continues it generates the rest of that turn and parses the whole turn's tool call. A sample
  with a checkpoint continues from it (persistent sessions are rebuilt by replaying their cells,
  which must answer as recorded, else the sample restarts from its prompt); while ``draining`` is
  set, a checkpointed sample stops at its next turn boundary after an interpreter output (never
  mid-turn, also not one resumed mid-turn) with ``SampleDrained``;
- when the response ends and a ground truth is known, it is scored by the reward service with the
  number of tool calls; the scored text is decoded with ``skip_special_tokens=True`` (no EOS or
  chat markers), while ``response_text`` is the plain decode of ``response_ids``.
Invariant: ``len(response_ids) == len(loss_mask) == len(logprobs) == len(versions)`` and the
masked positions are exactly the interpreter tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from services.chat.format import build_prompt, tool_result_ids
from services.chat.tool_result import ToolResult
from services.chat.toolcall import ToolCall, parse_code_call, parse_hermes_call
from services.common.schemas import RolloutSampling, Trajectory
from services.rollout.agent.checkpoint import JobCheckpoints, SampleCheckpoint
from services.rollout.agent.drain import SampleDrained
from services.rollout.config import AgentConfig
from services.rollout.engine.base import Engine, SamplingParams
from services.transport.sandbox.client import SandboxUnavailable

EventSink = Callable[[dict[str, Any]], Awaitable[None]]

ANSWER_STOP = "</answer>"


class Tokenizer(Protocol):
    eos_token_id: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class ToolRunner(Protocol):
    async def run(self, code: str) -> ToolResult: ...


class SessionToolRunner(Protocol):
    """What ``tool_session: persistent`` needs: ``run`` in a session, and its open and close."""

    async def open_session(self) -> str: ...

    async def run(self, code: str, session_id: str | None = None) -> ToolResult: ...

    async def close_session(self, session_id: str) -> None: ...


class Scorer(Protocol):
    async def score(
        self, response: str, ground_truth: str, *, num_tool_calls: int = 0, data_source: str | None = None
    ) -> Any: ...


class AgentObserver:
    """Metric hooks; the default does nothing (the server plugs Prometheus in)."""

    def tokens_generated(self, n: int) -> None: ...

    def tool_called(self, latency_s: float, error: bool) -> None: ...

    def response_done(self, traj: Trajectory) -> None: ...


class RewardUnavailable(RuntimeError):
    """The reward service could not score a finished response (after retries)."""


@dataclass
class _State:
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_call_errors: list[bool] = field(default_factory=list)
    first_code_token: int | None = None
    turn_start: int | None = None  # while a turn is generated: where it starts; None between turns
    session_id: str | None = None  # tool_session persistent: opened at the first tool call
    cells: list[tuple[str, str]] = field(default_factory=list)  # persistent: (code, output) run in it

    def add_generated(self, ids: list[int], lps: list[float], vers: list[int]) -> None:
        if not (len(ids) == len(lps) == len(vers)):
            raise RuntimeError(
                f"engine returned {len(ids)} tokens, {len(lps)} log-probs, {len(vers)} versions"
            )
        self.response_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(map(float, lps))  # map: no generator frame per token (bench/scale.py profile)
        self.versions.extend(map(int, vers))

    def add_tool(self, ids: list[int]) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))


def splits_a_stop(text: str, stops: list[str]) -> bool:
    """Whether a cut after ``text`` could split a stop string: ``text`` ends with a proper prefix of
    one (``</co`` of ``</code>``) or with an incomplete character (a byte-level token holding part of
    a UTF-8 sequence decodes to U+FFFD). A turn continued from such a cut would miss that stop."""
    return text.endswith("\ufffd") or any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)))


class AgentLoop:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        tools: ToolRunner,
        cfg: AgentConfig,
        scorer: Scorer | None = None,
        observer: AgentObserver | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = tools
        self.cfg = cfg
        self.scorer = scorer
        self.observer = observer or AgentObserver()
        self.draining = asyncio.Event()  # set on drain: samples stop at their next turn boundary

    # -- prompt ---------------------------------------------------------------------------------
    def build_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        return build_prompt(self.tokenizer, messages, self.cfg)

    def _parse(self, turn_text: str) -> ToolCall:
        if self.cfg.tool_format == "code":
            return parse_code_call(turn_text)
        return parse_hermes_call(turn_text, self.cfg.tool_name)

    # -- one response ---------------------------------------------------------------------------
    async def run_one(
        self,
        prompt_ids: list[int],
        *,
        index: int = 0,
        sampling: RolloutSampling | None = None,
        max_turns: int | None = None,
        ground_truth: str | None = None,
        data_source: str | None = None,
        request_id: str = "req",
        on_event: EventSink | None = None,
        checkpoints: JobCheckpoints | None = None,
    ) -> Trajectory:
        sampling = sampling or RolloutSampling()
        max_turns = self.cfg.max_turns if max_turns is None else max_turns
        budget = sampling.max_tokens or self.cfg.max_response_tokens
        stops = [self.cfg.tool_stop] + ([ANSWER_STOP] if self.cfg.stop_at_answer else [])
        seed = None if sampling.seed is None else sampling.seed + index
        # the engine's context (prompt + response) bounds the budget too, when the engine tells it
        ctx = getattr(self.engine, "max_context", None)
        if isinstance(ctx, int):
            budget = min(budget, ctx - 1 - len(prompt_ids))
        st = _State()
        done: tuple[str, bool] | None = None
        try:
            if checkpoints is not None:
                st, done = await self._resume(checkpoints, index)
                checkpoints.live[index] = st
            if done is None:
                finish, truncated = await self._turns(st, prompt_ids, index, sampling, max_turns, budget,
                                                      stops, seed, request_id, on_event, checkpoints)
                if checkpoints is not None:  # the final state too: a drained sibling does not redo it
                    await checkpoints.save(index, st, (finish, truncated), wait=True)
            else:
                finish, truncated = done
        finally:
            if checkpoints is not None:
                checkpoints.live.pop(index, None)
            if st.session_id is not None:  # the trajectory's live interpreter ends with it
                await self.tools.close_session(st.session_id)  # type: ignore[attr-defined]
        traj = await self._finish(st, index, finish, truncated, ground_truth, data_source)
        self.observer.response_done(traj)
        if on_event is not None:
            await on_event({"type": "done", "index": index, "trajectory": traj.model_dump(mode="json")})
        return traj

    async def _resume(self, checkpoints: JobCheckpoints,
                      index: int) -> tuple[_State, tuple[str, bool] | None]:
        """The state sample ``index`` starts from (its checkpoint's, or empty) and, when the checkpoint
        is of a finished sample, its (finish reason, truncated)."""
        ck = checkpoints.resume_point(index, self.engine.version)
        if ck is None:
            return _State(), None
        st = _State(ck.response_ids, ck.loss_mask, ck.logprobs, ck.versions, ck.turns, ck.tool_calls,
                    ck.tool_errors, ck.tool_call_errors, ck.first_code_token, turn_start=ck.turn_start,
                    cells=list(ck.cells))
        if ck.cells and ck.finish is None and not await self._replay(st, ck):
            checkpoints.restart(index, "replay_mismatch")
            return _State(), None
        checkpoints.resumed(index, ck)
        return st, ck.finish

    async def _replay(self, st: _State, ck: SampleCheckpoint) -> bool:
        """Rebuild the persistent session: run its recorded cells in order in a new session; False
        (session closed) at the first output that differs from the recorded one."""
        tools: SessionToolRunner = self.tools  # type: ignore[assignment]
        try:
            st.session_id = await tools.open_session()
        except SandboxUnavailable:
            raise
        except Exception:  # noqa: BLE001 - no session to replay into: restart the sample
            return False
        for code, recorded in ck.cells:
            if (await tools.run(code, session_id=st.session_id)).text != recorded:
                await tools.close_session(st.session_id)
                st.session_id = None
                return False
        return True

    async def _turns(self, st: _State, prompt_ids: list[int], index: int, sampling: RolloutSampling,
                     max_turns: int, budget: int, stops: list[str], seed: int | None, request_id: str,
                     on_event: EventSink | None,
                     checkpoints: JobCheckpoints | None = None) -> tuple[str, bool]:
        """Generate and call tools until the response ends; returns (finish reason, truncated)."""
        finish: str
        truncated = False
        while True:
            # a turn boundary, checkpointed (not a turn resumed from a mid-turn checkpoint)
            if checkpoints is not None and self.draining.is_set() and st.turn_start is None:
                await checkpoints.flush()
                raise SampleDrained(f"{request_id}-{index}: drained after {st.turns} turns")
            remaining = budget - len(st.response_ids)
            if remaining <= 0:
                finish, truncated = "length", True
                break
            params = SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=remaining,
                stop=stops,
                seed=None if seed is None else seed + 1_000_003 * st.turns,  # a fresh stream per turn
                n=1,
            )
            gen_start = len(st.response_ids)
            turn_start = st.turn_start = gen_start if st.turn_start is None else st.turn_start
            reason, stop_str = None, None
            swapped = False  # a weight swap in this turn not checkpointed yet
            try:
                async for chunk in self.engine.generate(
                    prompt_ids + st.response_ids, params, f"{request_id}-{index}-t{st.turns}"
                ):
                    if chunk.token_ids:
                        before = len(st.response_ids)
                        st.add_generated(chunk.token_ids, chunk.logprobs, chunk.versions)
                        # newer than the turn's previous token (or, first in the turn, the chunk's first)
                        ref = st.versions[before - 1 if before > turn_start else before]
                        swapped = swapped or st.versions[-1] > ref
                        if on_event is not None:
                            await on_event(
                                {
                                    "type": "token",
                                    "index": index,
                                    "token_ids": list(chunk.token_ids),
                                    "text": self.tokenizer.decode(chunk.token_ids),
                                }
                            )
                    if chunk.finished:
                        reason, stop_str = chunk.finish_reason, chunk.stop_str
                    elif swapped and checkpoints is not None and not self._splits_stop(st, stops):
                        swapped = False
                        await checkpoints.save(index, st)  # mid-turn: records st.turn_start
            finally:  # counted once per turn, not per chunk (a lock per chunk showed in the profile)
                self.observer.tokens_generated(len(st.response_ids) - gen_start)
            st.turn_start = None
            st.turns += 1
            if reason == "stop" and stop_str == self.cfg.tool_stop:
                if st.tool_calls >= max_turns:
                    finish = "max_turns"
                    break
                st.tool_calls += 1
                turn_text = self.tokenizer.decode(st.response_ids[turn_start:])
                if st.first_code_token is None:
                    st.first_code_token = turn_start + self._open_tag_offset(st.response_ids[turn_start:],
                                                                             turn_text)
                out = await self._call_tool(turn_text, index, on_event, st)
                st.tool_call_errors.append(out.error)
                if out.error:
                    st.tool_errors += 1
                ids = tool_result_ids(self.tokenizer, out.text, self.cfg)
                room = budget - len(st.response_ids)
                st.add_tool(ids[:room])
                if len(ids) > room:
                    finish, truncated = "length", True
                    break
                if checkpoints is not None:
                    await checkpoints.save(index, st)
                continue
            if reason == "stop" and stop_str == ANSWER_STOP:
                finish = "answer"
            elif reason == "stop" or reason == "eos":
                finish = "eos"
            elif reason == "length":
                finish, truncated = "length", True
            else:  # abort, or a stream that ended without a finished chunk
                finish = "abort"
            break
        return finish, truncated

    def _splits_stop(self, st: _State, stops: list[str]) -> bool:
        """Whether the open turn so far ends inside a stop string (``splits_a_stop``); decodes only
        its last tokens: at most one token per byte of the longest stop (each token holds a byte)."""
        assert st.turn_start is not None
        tail = max(st.turn_start, len(st.response_ids) - max(len(s.encode()) for s in stops))
        return splits_a_stop(self.tokenizer.decode(st.response_ids[tail:]), stops)

    def _open_tag_offset(self, turn_ids: list[int], turn_text: str) -> int:
        """Tokens of the turn before the one where the call's last opening tag (``<code>``) starts;
        the whole turn when it has none (a malformed call). The decoded prefixes grow with their
        length, so a binary search finds the first prefix that reaches past the tag's start."""
        tag = "<code>" if self.cfg.tool_format == "code" else "<tool_call>"
        at = turn_text.rfind(tag)
        if at < 0:
            return len(turn_ids)
        lo, hi = 0, len(turn_ids)  # smallest k with len(decode(turn_ids[:k])) > at
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tokenizer.decode(turn_ids[:mid])) > at:
                hi = mid
            else:
                lo = mid + 1
        return max(lo - 1, 0)

    async def _run_tool(self, code: str, st: _State) -> ToolResult:
        if self.cfg.tool_session == "stateless":
            return await self.tools.run(code)
        tools: SessionToolRunner = self.tools  # type: ignore[assignment]
        if st.session_id is None:
            try:
                st.session_id = await tools.open_session()
            except SandboxUnavailable:
                raise  # an outage fails the group (see sandbox.py), it is not the model's doing
            except Exception as exc:  # noqa: BLE001 - the model sees why, the next call tries again
                return ToolResult(f"Sandbox error: {exc}", True)
        out = await tools.run(code, session_id=st.session_id)
        st.cells.append((code, out.text))  # replayed, in order, when the sample continues elsewhere
        return out

    async def _call_tool(self, turn_text: str, index: int, on_event: EventSink | None,
                         st: _State) -> ToolResult:
        call = self._parse(turn_text)
        if on_event is not None:
            await on_event({"type": "tool_call", "index": index, "code": call.code, "error": call.error})
        if call.error is not None:
            out = ToolResult(call.error, True)
        else:
            assert call.code is not None
            out = await self._run_tool(call.code, st)
            self.observer.tool_called(out.latency_s, out.error)
        if on_event is not None:
            await on_event({"type": "tool_result", "index": index, "text": out.text, "error": out.error})
        return out

    async def _finish(
        self,
        st: _State,
        index: int,
        finish: str,
        truncated: bool,
        ground_truth: str | None,
        data_source: str | None,
    ) -> Trajectory:
        text = self.tokenizer.decode(st.response_ids)
        reward = correct = extracted = reason = None
        if ground_truth is not None and self.scorer is not None:
            # the grader sees the text without special tokens (EOS, chat markers)
            clean = self.tokenizer.decode(st.response_ids, skip_special_tokens=True)
            res = await self._score(clean, ground_truth, st.tool_calls, data_source)
            correct, extracted, reason = res.correct, res.extracted, res.reason
            # timeout_policy=drop: no reward at all (the trainer drops the group), never a guess
            reward = float(res.score) if getattr(res, "train", True) else None
        return Trajectory(
            index=index,
            response_ids=st.response_ids,
            loss_mask=st.loss_mask,
            logprobs=st.logprobs,
            versions=st.versions,
            turns=st.turns,
            tool_calls=st.tool_calls,
            tool_errors=st.tool_errors,
            tool_call_errors=st.tool_call_errors,
            first_code_token=st.first_code_token,
            finish_reason=finish,
            truncated=truncated,
            reward=reward,
            correct=correct,
            extracted=extracted,
            reward_reason=reason,
            response_text=text if self.cfg.include_text else None,
        )

    async def _score(self, text: str, ground_truth: str, num_tool_calls: int, data_source: str | None) -> Any:
        """One grade; the scorer retries within its own budget (``RewardClient``), nobody above it."""
        assert self.scorer is not None
        try:
            return await self.scorer.score(
                text, ground_truth, num_tool_calls=num_tool_calls, data_source=data_source
            )
        except httpx.HTTPError as exc:
            raise RewardUnavailable(f"reward service failed: {type(exc).__name__}: {exc}") from exc

    # -- a group --------------------------------------------------------------------------------
    async def run_group(self, prompt_ids: list[int], n: int, **kwargs: Any) -> list[Trajectory]:
        """``n`` independent responses to one prompt, concurrently, ordered by index.

        If one response fails (engine or reward error), the others are cancelled and the error
        is raised: a group is complete or absent. A response that stops with ``SampleDrained``
        cancels nobody: the others go on to their own next turn boundary (checkpointed) or their
        end (checkpointed too), then ``SampleDrained`` is raised.
        """
        tasks = [asyncio.ensure_future(self.run_one(prompt_ids, index=i, **kwargs)) for i in range(n)]
        try:
            pending: set[asyncio.Future[Trajectory]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    exc = t.exception()
                    if exc is not None and not isinstance(exc, SampleDrained):
                        raise exc
            drained = [t.exception() for t in tasks if isinstance(t.exception(), SampleDrained)]
            if drained:
                raise drained[0]  # type: ignore[misc]
            return [t.result() for t in tasks]
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
