"""``POST /v1/rollouts``: one prompt in, a scored ``Group`` of ``n`` trajectories out (JSON), or
the same as server-sent events with ``stream``.

Invariants: every status it answers is declared (``ROLLOUT_RESPONSES``); a request over a limit
(``max_n``, ``max_prompt_tokens``, ``max_concurrent_requests``) is refused before any generation,
naming the field or the limit; ``state["in_flight"]`` (shared with the OpenAI routes) counts every
request being served, streamed or not, and is given back however the request ends.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.errors import error as api_error
from services.common.errors import field_error, responses
from services.common.logging import get_logger
from services.common.schemas import Group, version_range
from services.rollout.agent.drain import SampleDrained
from services.rollout.agent.loop import AgentLoop, RewardUnavailable, Scorer
from services.rollout.api import RolloutRequest, sse
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import Engine, engine_error
from services.rollout.metrics import RolloutMetrics
from services.transport.sandbox.client import SandboxUnavailable

log = get_logger("rollout")

# /v1/rollouts: JSON (a Group) or, with stream, server-sent events; and every error it answers
ROLLOUT_RESPONSES = {
    200: {"model": Group, "description": "the scored group, or with stream=true server-sent events",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **responses(400, 401, 422, 429, 502, 503, descriptions={
        502: "the sandbox or reward service failed",
        503: "the engine is down (restart the service), or the replica drains (send it elsewhere)"}),
}


def rollouts_router(cfg: RolloutConfig, engine: Engine, agent: AgentLoop, scorer: Scorer | None,
                    state: dict[str, Any], metrics: RolloutMetrics) -> APIRouter:
    """``engine``: the one the agent generates with (its health and policy version are read here)."""
    router = APIRouter()
    routes = _Rollouts(cfg, engine, agent, scorer, state, metrics)
    router.add_api_route("/v1/rollouts", routes.rollouts, methods=["POST"], response_model=None,
                         responses=ROLLOUT_RESPONSES)
    return router


class _Rollouts:
    def __init__(self, cfg: RolloutConfig, engine: Engine, agent: AgentLoop, scorer: Scorer | None,
                 state: dict[str, Any], metrics: RolloutMetrics) -> None:
        self.cfg, self.engine, self.agent, self.scorer = cfg, engine, agent, scorer
        self.state, self.metrics = state, metrics

    async def rollouts(self, req: RolloutRequest) -> JSONResponse | StreamingResponse:
        cfg, agent, state, metrics = self.cfg, self.agent, self.state, self.metrics
        if (error := engine_error(self.engine)) is not None:  # e.g. vLLM's engine core died: restart me
            metrics.requests.labels("rejected").inc()
            return api_error(503, f"engine unavailable: {error}")
        if state["draining"]:
            metrics.requests.labels("rejected").inc()
            return api_error(503, "this replica is draining (shutting down): send the request to another one")
        if req.n > cfg.max_n:
            return field_error(["body", "n"], f"n={req.n} exceeds the limit max_n={cfg.max_n}")
        if req.ground_truth is not None and self.scorer is None:
            return field_error(["body", "ground_truth"], "this server has no reward service (reward_url)")
        if state["in_flight"] >= cfg.max_concurrent_requests:
            metrics.requests.labels("rejected").inc()
            return api_error(429, "too many rollout requests in flight "
                             f"(max_concurrent_requests={cfg.max_concurrent_requests})")
        if req.prompt_ids is not None:
            prompt_ids = list(req.prompt_ids)
        else:
            assert req.messages is not None
            try:
                prompt_ids = agent.build_prompt([m.model_dump(exclude_none=True) for m in req.messages])
            except Exception as exc:  # a chat template may reject a message sequence
                return field_error(["body", "messages"], f"chat template failed: {exc}")
        if len(prompt_ids) > cfg.max_prompt_tokens:
            where = ["body", "prompt_ids" if req.prompt_ids is not None else "messages"]
            return field_error(
                where,
                f"prompt has {len(prompt_ids)} tokens, above the limit "
                f"max_prompt_tokens={cfg.max_prompt_tokens}",
            )
        job_id = req.request_id or uuid.uuid4().hex
        kwargs = {
            "sampling": req.sampling,
            "max_turns": req.max_turns,
            "ground_truth": req.ground_truth,
            "data_source": req.data_source,
            "request_id": job_id,
        }

        def group_of(trajs: list[Any]) -> Group:
            lo, hi = version_range(trajs)
            return Group(
                job_id=job_id,
                prompt_ids=prompt_ids,
                trajectories=trajs,
                ground_truth=req.ground_truth,
                data_source=req.data_source,
                min_version=lo,
                max_version=hi,
                replica="http",
            )

        if not req.stream:
            state["in_flight"] += 1
            metrics.in_flight.inc()
            try:
                trajs = await agent.run_group(prompt_ids, req.n, **kwargs)
            except RewardUnavailable as exc:
                metrics.requests.labels("reward_error").inc()
                return api_error(502, str(exc))
            except SandboxUnavailable as exc:
                metrics.requests.labels("sandbox_error").inc()
                return api_error(502, str(exc))
            except SampleDrained:
                metrics.requests.labels("rejected").inc()
                return api_error(503, "this replica drained (shut down) mid-rollout: send the request again")
            finally:
                state["in_flight"] -= 1
                metrics.in_flight.dec()
            metrics.requests.labels("ok").inc()
            return JSONResponse(group_of(trajs).model_dump(mode="json"))
        return StreamingResponse(
            _stream(agent, prompt_ids, req.n, kwargs, job_id, self.engine, state, metrics),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


async def _stream(
    agent: AgentLoop,
    prompt_ids: list[int],
    n: int,
    kwargs: dict[str, Any],
    job_id: str,
    engine: Engine,
    state: dict[str, Any],
    metrics: RolloutMetrics,
) -> AsyncIterator[bytes]:
    events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def sink(ev: dict[str, Any]) -> None:
        await events.put(ev)

    async def produce() -> None:
        try:
            await agent.run_group(prompt_ids, n, on_event=sink, **kwargs)
            await events.put({"type": "end", "job_id": job_id, "n": n, "weight_version": engine.version})
        except Exception as exc:
            log.error("streamed rollout failed", exc_info=True)
            await events.put({"type": "error", "detail": str(exc)})
        finally:
            await events.put(None)

    state["in_flight"] += 1
    metrics.in_flight.inc()
    task = asyncio.create_task(produce())
    ok = False
    try:
        while (ev := await events.get()) is not None:
            kind = ev.pop("type")
            ok = ok or kind == "end"
            yield sse(kind, ev)
    finally:
        # When the client goes away, Starlette cancels this generator, and its cancellation is
        # level-triggered (anyio): every ``await`` in here is cancelled again. So stop generating and
        # do the bookkeeping before the one await, which only reaps the (cancelled) producer.
        task.cancel()
        state["in_flight"] -= 1
        metrics.in_flight.dec()
        metrics.requests.labels("ok" if ok else "error").inc()
        await asyncio.gather(task, return_exceptions=True)
