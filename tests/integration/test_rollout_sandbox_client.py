"""The sandbox's one client (``services/transport/sandbox``) and the rollout's code tool over it.

- against the real sandbox service: what the model gets to see;
- the wire stays SandboxFusion's: the bytes the client sends are those of the plain dicts the
  rollout sent before the contract had models;
- a sandbox under ``isolation: degraded`` is refused (at the rollout's start and on every answer)
  unless ``agent.allow_degraded_sandbox``, and counted either way.

A real sandbox here has every isolation layer, so it cannot be degraded: the degraded sandbox is a
stand-in HTTP server on loopback that answers as the real one does under ``isolation: degraded``
(``X-Sandbox-Isolation`` on every response, ``"isolation": "degraded"`` in ``/healthz``), built
from the same contract models.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import AgentConfig, RolloutConfig
from services.rollout.server import create_app
from services.transport.sandbox.client import SandboxClient, SandboxDegraded
from services.transport.sandbox.schemas import (
    ISOLATION_HEADER,
    CommandRunResult,
    CommandRunStatus,
    RunCodeResponse,
    RunStatus,
    SandboxHealth,
    SessionResponse,
)
from tests.helpers.agent_fixtures import ScriptedEngine, make_tokenizer
from tests.helpers.uvicorn_app import serving

pytestmark = pytest.mark.integration

GAP = "memory cgroup: not writable"
NOTE = f"isolation degraded: {GAP}"


async def test_outputs_errors_and_timeouts_as_interpreter_text(sandbox_url: str) -> None:
    client = SandboxTool(SandboxClient(sandbox_url, run_timeout_s=1.0))
    try:
        await client.check_isolation()  # the real sandbox holds every layer: nothing refused
        ok = await client.run("import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 4, x))")
        assert (ok.text, ok.error) == ("[-2, 2]", False) and ok.latency_s > 0
        both = await client.run("import sys\nprint('out')\nprint('warn', file=sys.stderr)")
        assert both.text == "out\nwarn" and not both.error
        exc = await client.run("def f():\n    return 1/0\nf()")
        assert exc.error and "ZeroDivisionError: division by zero" in exc.text and "Traceback" in exc.text
        slow = await client.run("print('started', flush=True)\nwhile True:\n    pass")
        assert slow.error and "exceeded 1 seconds" in slow.text
        exit_code = await client.run("import sys\nsys.exit(3)")
        assert exit_code.error and "exited with code 3" in exit_code.text
        silent = await client.run("x = 1")
        assert (silent.text, silent.error) == ("", False)
        too_big = await client.run("x = 1\n" * 200_000)  # over the contract's 1 MiB: refused, said why
        assert too_big.error and too_big.text.startswith("Sandbox error: invalid request: code:")
    finally:
        await client.aclose()


async def test_answers_are_typed_and_a_missing_session_is_an_answer(sandbox_url: str) -> None:
    client = SandboxClient(sandbox_url)
    try:
        health = await client.health()
        assert isinstance(health, SandboxHealth) and not health.degraded and health.isolation_gaps == []
        answer = await client.run("print(6*7)")
        assert isinstance(answer.response, RunCodeResponse) and answer.error is None
        assert answer.response.status == RunStatus.Success and answer.response.run_result is not None
        assert answer.response.run_result.stdout == "42\n"
        gone = await client.run("print(1)", session_id="no-such-session")
        assert gone.response is None and gone.error and "no-such-session" in gone.error
    finally:
        await client.aclose()


def stand_in(degraded: bool) -> FastAPI:
    """A sandbox stand-in that records the raw bodies it is sent; ``degraded``: it answers as the
    real service does under ``isolation: degraded`` with one layer missing."""
    app = FastAPI()
    app.state.bodies = []

    @app.middleware("http")
    async def isolation(request: Request, call_next):  # type: ignore[no-untyped-def]
        response: Response = await call_next(request)
        if degraded:
            response.headers[ISOLATION_HEADER] = NOTE
        return response

    @app.get("/healthz")
    def healthz() -> SandboxHealth:
        gaps = [GAP] if degraded else []
        return SandboxHealth(status="ok", isolation="degraded" if degraded else "ok", isolation_gaps=gaps,
                             warnings=[f"isolation degraded: {g}" for g in gaps])

    @app.post("/run_code")
    async def run_code(request: Request) -> RunCodeResponse:
        app.state.bodies.append(await request.body())
        return RunCodeResponse(status=RunStatus.Success, message=NOTE if degraded else "",
                               run_result=CommandRunResult(status=CommandRunStatus.Finished, stdout="4\n",
                                                           stderr="", return_code=0))

    @app.post("/sessions")
    async def sessions(request: Request) -> SessionResponse:
        app.state.bodies.append(await request.body())
        return SessionResponse(session_id="s1", ttl_s=60.0, memory_limit_MB=1024)

    return app


async def test_the_bytes_on_the_wire_are_sandboxfusions() -> None:
    """What the rollout sent as plain dicts before the contract had models, byte for byte."""
    app = stand_in(degraded=False)
    async with serving(app) as url:
        client = SandboxClient(url, run_timeout_s=2.5, memory_mb=512)
        try:
            await client.run("print(2+2)")
            await client.open_session()
            await client.run("x", session_id="s1")
        finally:
            await client.aclose()
    before = [
        {"code": "print(2+2)", "language": "python", "run_timeout": 2.5, "memory_limit_MB": 512},
        {"memory_limit_MB": 512},
        {"code": "x", "language": "python", "run_timeout": 2.5, "memory_limit_MB": 512, "session_id": "s1"},
    ]
    assert app.state.bodies == [httpx.Request("POST", url, json=body).content for body in before]


async def test_a_degraded_sandbox_is_refused_on_every_answer_unless_allowed() -> None:
    seen: list[tuple[str, bool]] = []
    async with serving(stand_in(degraded=True)) as url:
        refusing = SandboxTool(SandboxClient(url, on_degraded=lambda note, ok: seen.append((note, ok))))
        allowing = SandboxTool(SandboxClient(url, allow_degraded=True,
                                             on_degraded=lambda note, ok: seen.append((note, ok))))
        try:
            with pytest.raises(SandboxDegraded, match="allow_degraded_sandbox"):
                await refusing.check_isolation()
            with pytest.raises(SandboxDegraded, match=GAP):  # an outage, never a tool result
                await refusing.run("print(2+2)")
            with pytest.raises(SandboxDegraded):
                await refusing.open_session()
            await allowing.check_isolation()
            used = await allowing.run("print(2+2)")
            assert (used.text, used.error) == ("4", False)
        finally:
            await refusing.aclose()
            await allowing.aclose()
    assert seen == [(NOTE, False)] * 3 + [(NOTE, True)] * 2


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


async def test_the_rollout_refuses_to_start_against_a_degraded_sandbox_unless_allowed() -> None:
    tok = make_tokenizer()
    async with serving(stand_in(degraded=True)) as url:
        refusing = create_app(RolloutConfig(sandbox_url=url, model="scripted"), ScriptedEngine(tok, {}), tok)
        with pytest.raises(SandboxDegraded, match=GAP):
            async with refusing.router.lifespan_context(refusing):
                pass
        cfg = RolloutConfig(sandbox_url=url, model="scripted", agent=AgentConfig(allow_degraded_sandbox=True))
        script = {0: ["<code>print(2+2)</code>", "<answer>4</answer>"]}
        app = create_app(cfg, ScriptedEngine(tok, script), tok)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://rollout") as c:
                r = await c.post("/v1/rollouts", json={"messages": [{"role": "user", "content": "2+2?"}],
                                                       "n": 1, "max_turns": 2})
                assert r.status_code == 200, r.text
                assert "\n<interpreter>\n4\n</interpreter>\n" in r.json()["trajectories"][0]["response_text"]
                metrics = (await c.get("/metrics")).text
    # the start check and the one tool call; nothing refused
    assert _metric(metrics, 'rollout_sandbox_degraded_answers_total{action="used"}') == 2.0
    assert _metric(metrics, 'rollout_sandbox_degraded_answers_total{action="refused"}') == 0.0
