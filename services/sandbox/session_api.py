"""HTTP side of sessions: ``POST /sessions``, ``GET``/``DELETE /sessions/{id}``, ``/run_code`` with
``session_id``, SandboxFusion's ``/run_jupyter``, and the session metrics.

Statuses: 429 when ``max_sessions`` are live (a message says how to free one), 404 for an
unknown id, 410 for a session that ended (the message says why: memory, time limit,
expiry, close, a lost worker), 422 for fields a session cannot honour. A cell's own
result uses SandboxFusion's shape; its last-line expression is appended to stdout (as a
notebook displays it), its plots come as ``display`` (``image/png``), and a cell that
ended its session says so in ``message``. ``/run_jupyter`` runs on after a cell that
raised, as SandboxFusion does; it stops only when the session itself ended (a cell past
its time limit, memory, a crash: later cells would have lost every earlier cell's state).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from services.common.errors import error, field_error, responses
from services.common.metrics import MetricsRegistry
from services.sandbox.config import SandboxConfig
from services.sandbox.executor import POD_NAME, to_response
from services.sandbox.limits import resolve_limits
from services.sandbox.protocol import RunOutcome
from services.sandbox.sessions import SessionEnded, SessionLimit, SessionRegistry, SessionUnknown
from services.transport.sandbox.schemas import (
    CellRunResult,
    CommandRunResult,
    CommandRunStatus,
    RunCodeRequest,
    RunJupyterRequest,
    RunJupyterResponse,
    RunStatus,
    SessionCellResponse,
    SessionRequest,
    SessionResponse,
)


class SessionInfo(BaseModel):
    """``GET /sessions/{id}``."""

    session_id: str
    ttl_s: float
    memory_limit_MB: int
    cells: int
    idle_s: float
    pids: list[int] = Field(description="host pids: [init, interpreter]")


class SessionClosed(BaseModel):
    """``DELETE /sessions/{id}``: how the session ended (``closed``, or how it had ended before)."""

    session_id: str
    ended: str


# the statuses each route answers besides 200 (and FastAPI's own 422), declared in /openapi.json
SESSION_ERRORS = (401, 404, 410)
OPEN_ERRORS = (400, 401, 422, 429, 503)


class SessionAPI:
    def __init__(self, cfg: SandboxConfig, registry: SessionRegistry, metrics: MetricsRegistry,
                 notes: Callable[[], tuple[str, ...]] = tuple) -> None:
        """``notes()``: what every answer must say (the executor's degraded-isolation note)."""
        self.cfg = cfg
        self.registry = registry
        self.notes = notes
        metrics.gauge("sessions_live", "Live interpreter sessions").set_function(lambda: len(registry.live))
        metrics.gauge("sessions_memory_bytes", "Memory charged to live sessions (their cgroups)"
                      ).set_function(registry.memory_bytes)
        self.opened = metrics.counter("sessions_opened_total", "Sessions opened")
        self.rejected = metrics.counter("session_rejections_total", "POST /sessions answered 429")
        self.ended = metrics.counter("sessions_ended_total", "Sessions ended, by reason", ("reason",))
        self.cells = metrics.counter("session_cells_total", "Cells run in sessions, by status", ("status",))
        for kind in ("closed", "expired", "cell_timeout", "memory", "lifetime", "worker_lost", "died"):
            self.ended.labels(kind)
        for status in RunStatus:
            self.cells.labels(status.value)
        registry.on_end = lambda kind: self.ended.labels(kind).inc()

    def mount(self, app: FastAPI) -> None:
        app.post("/sessions", response_model=SessionResponse, responses=responses(*OPEN_ERRORS))(self.open)
        app.get("/sessions/{session_id}", response_model=SessionInfo,
                responses=responses(*SESSION_ERRORS))(self.describe)
        app.delete("/sessions/{session_id}", response_model=SessionClosed,
                   responses=responses(401, 404))(self.close)
        app.post("/run_jupyter", response_model=RunJupyterResponse,
                 responses=responses(*OPEN_ERRORS, *SESSION_ERRORS))(self.run_jupyter)

    async def open(self, req: SessionRequest) -> SessionResponse | JSONResponse:
        try:
            s, notes = await self.registry.open(req.ttl_s, req.memory_limit_MB, req.cpu_cores)
        except SessionLimit as exc:
            self.rejected.inc()
            return error(429, str(exc), retry_after=1)
        except (RuntimeError, OSError, TimeoutError) as exc:
            return error(503, f"could not start a session: {exc}")
        self.opened.inc()
        return SessionResponse(session_id=s.id, ttl_s=s.ttl_s, memory_limit_MB=s.memory_mb,
                               message="; ".join([*self.notes(), *notes]))

    async def describe(self, session_id: str) -> SessionInfo | JSONResponse:
        try:
            s = self.registry.get(session_id)
        except SessionEnded as exc:
            return error(410, str(exc))
        except SessionUnknown as exc:
            return error(404, str(exc))
        return SessionInfo(session_id=s.id, ttl_s=s.ttl_s, memory_limit_MB=s.memory_mb, cells=s.cells,
                           idle_s=round(time.monotonic() - s.last_used, 3), pids=s.pids)

    async def close(self, session_id: str) -> SessionClosed | JSONResponse:
        try:
            reason = await self.registry.close(session_id)
        except SessionUnknown as exc:
            return error(404, str(exc))
        return SessionClosed(session_id=session_id, ended=reason)

    async def run_code(self, req: RunCodeRequest) -> JSONResponse:
        """``/run_code`` with ``session_id``: one cell in that session's live interpreter (a
        ``SessionCellResponse``, sent as is: ``/run_code``'s response model would drop ``display``)."""
        assert req.session_id is not None
        if req.stdin:
            return field_error(["body", "stdin"],
                               "stdin is not supported with session_id (a session's cells read no stdin)")
        limits = resolve_limits(req, self.cfg)
        notes = (*self.notes(), *(n for n in limits.notes if n.startswith("run_timeout")))
        try:
            outcome = await self.registry.run_cell(req.session_id, req.code, limits.timeout_s,
                                                   req.decoded_files(), list(req.fetch_files))
        except SessionEnded as exc:
            return error(410, str(exc))
        except SessionUnknown as exc:
            return error(404, str(exc))
        resp = cell_response(outcome, notes, req.session_id)
        self.cells.labels(resp.status.value).inc()
        return JSONResponse(resp.model_dump(mode="json"))

    async def run_jupyter(self, req: RunJupyterRequest) -> RunJupyterResponse | JSONResponse:
        """SandboxFusion's notebook run: every cell in order, an exception in one not stopping the rest.

        Without ``session_id`` a fresh session runs them and is closed after (SandboxFusion's
        semantics); with it, they run in that live session, which stays open."""
        cfg = self.cfg
        # cell_timeout 0 (SandboxFusion's default): no limit per cell but total_timeout (and ours)
        cell_timeout = min(req.cell_timeout or cfg.max_run_timeout_s, cfg.max_run_timeout_s)
        temporary = req.session_id is None
        if temporary:
            try:
                s, _ = await self.registry.open(None, req.memory_limit_MB, req.cpu_cores)
            except SessionLimit as exc:
                self.rejected.inc()
                return error(429, str(exc), retry_after=1)
            except (RuntimeError, OSError, TimeoutError) as exc:
                return error(503, f"could not start a session: {exc}")
            sid = s.id
        else:
            assert req.session_id is not None
            sid = req.session_id
        try:
            return await self._cells(sid, req, cell_timeout)
        except SessionEnded as exc:
            return error(410, str(exc))
        except SessionUnknown as exc:
            return error(404, str(exc))
        finally:
            if temporary:
                await self.registry.close(sid)

    async def _cells(self, sid: str, req: RunJupyterRequest, cell_timeout: float) -> RunJupyterResponse:
        start = time.monotonic()
        deadline = start + req.total_timeout
        cells: list[CellRunResult] = []
        status, driver_status, ended = RunStatus.Success, CommandRunStatus.Finished, ""
        files = req.decoded_files()
        for code in req.cells:
            left = deadline - time.monotonic()
            if left <= 0:
                driver_status, status = CommandRunStatus.TimeLimitExceeded, RunStatus.Failed
                break
            limit = min(cell_timeout, left)
            out = await self.registry.run_cell(sid, code, limit, files, [])
            files = {}
            cells.append(_cell_result(out, limit))
            if out.timed_out and limit < cell_timeout:
                driver_status = CommandRunStatus.TimeLimitExceeded
            if out.timed_out or out.session_ended:  # the interpreter is gone: no later cell can run
                ended = f"session {sid} ended: {out.session_ended or 'a cell ran past its time limit'}"
                status = RunStatus.Failed
                break
        messages = [*self.notes(), *([ended] if ended else [])]
        fetched: dict[str, str] = {}
        if req.fetch_files and not ended:
            out = await self.registry.run_cell(sid, "", cell_timeout, {}, list(req.fetch_files))
            fetched = {p: base64.b64encode(d).decode() for p, d in out.files.items()}
            messages += [f"fetch_files {p!r} skipped: {why}" for p, why in out.fetch_notes.items()]
        driver = CommandRunResult(status=driver_status, execution_time=time.monotonic() - start,
                                  return_code=0 if status == RunStatus.Success else 1)
        return RunJupyterResponse(status=status, message="; ".join(messages), driver=driver, cells=cells,
                                  files=fetched, executor_pod_name=POD_NAME)


def cell_response(outcome: RunOutcome, notes: tuple[str, ...], sid: str) -> SessionCellResponse:
    resp = SessionCellResponse(**dict(to_response(outcome, notes)))
    if outcome.display is not None and resp.run_result is not None:
        resp.run_result.stdout = (resp.run_result.stdout or "") + outcome.display + "\n"
    resp.display = list(outcome.figures)
    if outcome.session_ended:
        ended = f"session {sid} ended: {outcome.session_ended}; its state is lost, open a new session"
        resp.message = "; ".join(m for m in (resp.message, ended) if m)
        if resp.status == RunStatus.Success:
            resp.status = RunStatus.Failed
    return resp


def _cell_result(out: RunOutcome, limit: float) -> CellRunResult:
    resp = to_response(out)
    run = resp.run_result
    error = [out.error_info] if out.error_info else []
    if out.timed_out:
        error = [{"ename": "TimeoutError", "evalue": f"cell exceeded its time limit of {limit:g} s",
                  "traceback": []}]
    elif out.session_ended and not error:
        error = [{"ename": "SessionEnded", "evalue": out.session_ended, "traceback": []}]
    stdout, stderr = (run.stdout or "", run.stderr or "") if run else ("", "")
    display = [{"text/plain": out.display}] if out.display is not None else []
    display += out.figures  # after the cell's result, as the inline backend shows plots
    return CellRunResult(stdout=stdout, stderr=stderr, display=display, error=error)
