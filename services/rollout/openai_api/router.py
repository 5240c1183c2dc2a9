"""FastAPI router: ``POST /v1/chat/completions`` (JSON or SSE) and ``GET /v1/models[/{id}]``.

Limits and accounting are the rollout API's: ``n <= max_n``, ``max_prompt_tokens``, and one
in-flight count shared with ``/v1/rollouts`` under ``max_concurrent_requests`` (429 beyond it).
The served model id is the configured ``model`` (as vLLM names it by default); a request for
another model is a 404. Errors use OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``: a bad request is a 400 whose ``param`` names the field (``messages[2].token_ids``).
With ``security.token`` set, the service's bearer-token door (services/common/http_auth.py) guards
these routes as it does ``/v1/rollouts``: the official client's ``api_key`` is that token (it is sent
as ``Authorization: Bearer``); without one, the key is ignored.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from services.common.errors import ApiError
from services.common.logging import get_logger
from services.rollout.agent.loop import Tokenizer
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import Engine
from services.rollout.metrics import RolloutMetrics
from services.rollout.openai_api import completion
from services.rollout.openai_api.completion import GenerationAborted, TurnPlan
from services.rollout.openai_api.render import ChatRenderer, RenderError
from services.rollout.openai_api.responses import (
    ChatCompletion,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from services.rollout.openai_api.schemas import ChatCompletionRequest

log = get_logger("rollout.openai")

# Declared in /openapi.json: every status these routes answer. OpenAI's error shape (what its clients
# read), except the 401 of the service's bearer-token door, which answers every route alike.
_DOOR = {401: {"model": ApiError, "description": "missing or wrong bearer token (when the service has one)"}}
_CHAT_ERRORS = {
    400: "a bad request: param names the field",
    404: "no such model",
    429: "too many requests in flight",
    500: "generation failed",
    503: "generation aborted (the engine stopped)",
}
CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ChatCompletion, "description": "a chat completion, or with stream=true server-sent "
          "events of chat.completion.chunk objects",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **_DOOR, **{s: {"model": ErrorResponse, "description": d} for s, d in _CHAT_ERRORS.items()},
}
# the body is parsed by the route itself (OpenAI's 400 shape, not FastAPI's 422): declared here,
# its nested models referenced inside this very schema (a JSON pointer from the document's root)
_BODY_AT = "#/paths/~1v1~1chat~1completions/post/requestBody/content/application~1json/schema/$defs/{model}"
CHAT_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": ChatCompletionRequest.model_json_schema(ref_template=_BODY_AT)}}}}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        err = ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=err).model_dump(mode="json")

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())


def openai_router(
    cfg: RolloutConfig, engine: Engine, tokenizer: Tokenizer, metrics: RolloutMetrics, state: dict[str, Any]
) -> APIRouter:
    """``state["in_flight"]`` is the app's count of requests being served (shared with /v1/rollouts)."""
    routes = _OpenAIRoutes(cfg, engine, tokenizer, metrics, state)
    router = APIRouter()
    router.add_api_route("/v1/models", routes.models, methods=["GET"], response_model=ModelList,
                         responses=_DOOR)
    router.add_api_route("/v1/models/{model:path}", routes.model, methods=["GET"], response_model=ModelCard,
                         responses={**_DOOR, 404: {"model": ErrorResponse, "description": "no such model"}})
    router.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"], response_model=None,
                         responses=CHAT_RESPONSES, openapi_extra=CHAT_BODY)
    return router


class _OpenAIRoutes:
    def __init__(self, cfg: RolloutConfig, engine: Engine, tokenizer: Tokenizer, metrics: RolloutMetrics,
                 state: dict[str, Any]) -> None:
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.metrics, self.state = metrics, state
        self.served = cfg.model or "retool"
        self.started = int(time.time())
        self.renderer = ChatRenderer(tokenizer)
        self.requests = metrics.registry.counter(
            "openai_requests_total", "OpenAI-API chat completions by outcome", ("outcome",)
        )
        for outcome in ("ok", "bad_request", "rejected", "error"):
            self.requests.labels(outcome)

    def card(self) -> ModelCard:
        ctx = getattr(self.engine, "max_context", None)
        return ModelCard(id=self.served, created=self.started, root=self.cfg.model,
                         max_model_len=ctx if isinstance(ctx, int) else None,
                         policy_version=self.engine.version)

    async def models(self) -> JSONResponse:
        return JSONResponse(ModelList(data=[self.card()]).model_dump(mode="json"))

    async def model(self, model: str) -> JSONResponse:
        if model != self.served:
            return _no_such_model(model).response()
        return JSONResponse(self.card().model_dump(mode="json"))

    async def chat(self, request: Request) -> JSONResponse | StreamingResponse:
        cfg, state, metrics, requests = self.cfg, self.state, self.metrics, self.requests
        try:
            req = await _parse(request)
            plan = self._plan(req)
        except OpenAIError as err:
            requests.labels("bad_request").inc()
            return err.response()
        if state["in_flight"] >= cfg.max_concurrent_requests:
            requests.labels("rejected").inc()
            return OpenAIError(
                429,
                "too many requests in flight (max_concurrent_requests="
                f"{cfg.max_concurrent_requests}); retry later",
                type_="rate_limit_error", code="rate_limit_exceeded",
            ).response()
        if req.stream:
            return StreamingResponse(self._sse(plan), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        state["in_flight"] += 1
        metrics.in_flight.inc()
        try:
            result = await completion.complete(self.engine, plan, self.tokenizer, metrics.tokens_generated)
        except Exception as exc:
            requests.labels("error").inc()
            return _server_error(exc).response()
        finally:
            state["in_flight"] -= 1
            metrics.in_flight.dec()
        requests.labels("ok").inc()
        return JSONResponse(result.model_dump(mode="json"))

    async def _sse(self, plan: TurnPlan) -> AsyncIterator[bytes]:
        state, metrics = self.state, self.metrics
        state["in_flight"] += 1
        metrics.in_flight.inc()
        outcome = "error"
        try:
            try:
                parts = completion.stream(self.engine, plan, self.tokenizer, metrics.tokens_generated)
                async for part in parts:
                    yield _data(part.model_dump(mode="json"))
                outcome = "ok"
            except Exception as exc:  # the status line is sent: report in-band, as vLLM does
                yield _data(_server_error(exc).body())
            yield b"data: [DONE]\n\n"
        finally:
            # bookkeeping before any await: a client that went away cancels every await in here
            state["in_flight"] -= 1
            metrics.in_flight.dec()
            self.requests.labels(outcome).inc()

    def _plan(self, req: ChatCompletionRequest) -> TurnPlan:
        cfg, served = self.cfg, self.served
        if req.model != served:
            raise _no_such_model(req.model)
        if req.n > cfg.max_n:
            raise OpenAIError(400, f"n={req.n} exceeds the limit max_n={cfg.max_n}", param="n")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            prompt_ids = self.renderer.render(req.messages, tools)
        except RenderError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
        if len(prompt_ids) > cfg.max_prompt_tokens:
            raise OpenAIError(
                400,
                f"messages: the prompt has {len(prompt_ids)} tokens, above the limit "
                f"max_prompt_tokens={cfg.max_prompt_tokens}",
                param="messages",
            )
        budget = req.completion_budget or cfg.agent.max_response_tokens
        ctx = getattr(self.engine, "max_context", None)
        if isinstance(ctx, int):
            room = ctx - 1 - len(prompt_ids)
            if room < 1:
                raise OpenAIError(
                    400, f"messages: the prompt has {len(prompt_ids)} tokens and leaves no room in the "
                    f"model's context of {ctx}", param="messages")
            budget = min(budget, room)
        return TurnPlan(
            model=served,
            prompt_ids=prompt_ids,
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_tokens=budget,
            seed=req.seed,
            stops=req.stops,
            tool_names=frozenset(t.function.name for t in req.tools or []) if req.tools_active else None,
            logprobs=req.logprobs,
            token_arrays=req.return_token_ids,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
        )


async def _parse(request: Request) -> ChatCompletionRequest:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        param = _param(body, errors[0]["loc"])
        parts = [f"{_param(body, e['loc']) or 'body'}: {_message(e['msg'])}" for e in errors[:3]]
        raise OpenAIError(400, "; ".join(parts), param=param or None) from None


def _message(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def _param(body: Any, loc: tuple[Any, ...]) -> str:
    """The path of ``loc`` that exists in the request (pydantic adds union-member tags to locs),
    plus a missing field's name, written as OpenAI does: ``messages[0].content``."""
    out = ""
    node = body
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str):
            out += f".{part}" if out else part
            if part not in node:
                break
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            out += f"[{part}]"
            node = node[part]
        else:
            break
    return out


def _no_such_model(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _server_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, ValueError):  # an engine refusing an input (e.g. a token id it cannot embed)
        return OpenAIError(400, str(exc))
    if isinstance(exc, GenerationAborted):
        return OpenAIError(503, str(exc), type_="server_error")
    log.error("chat completion failed", exc_info=exc)
    return OpenAIError(500, f"generation failed: {type(exc).__name__}: {exc}", type_="server_error")


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
