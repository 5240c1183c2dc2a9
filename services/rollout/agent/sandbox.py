"""The agent's code tool: runs tool code through the sandbox client and renders the answer.

Invariants:
- the wire is ``services.transport.sandbox`` (one client, one set of models); the text the model
  sees is ``services.chat.tool_result`` (one renderer): this module only joins the two;
- an outage (``SandboxUnavailable``, including ``SandboxDegraded``: a sandbox with isolation
  degraded that the rollout may not use) is raised, never shown to the model: it fails the whole
  group, and the rollout worker leaves its job pending for another try (dead-lettered after
  ``max_deliveries``), so a restarting sandbox never turns trajectories into "no tools" ones
  silently (ToRL #27);
- what the sandbox *answered* (a run's failure, a 4xx, odd JSON, a session that ended, and why)
  is a ``ToolResult`` with ``error=True`` and a text saying what went wrong: the model sees it.
"""

from __future__ import annotations

import httpx

from services.chat.tool_result import ToolResult, format_run_result, sandbox_error
from services.common.logging import get_logger
from services.transport.sandbox.client import SandboxClient, SandboxDegraded

log = get_logger("rollout")


class SandboxTool:
    """``ToolRunner`` / ``SessionToolRunner`` of the agent loop over one ``SandboxClient``."""

    def __init__(self, client: SandboxClient) -> None:
        self.client = client

    async def check_isolation(self) -> None:
        """At start: a sandbox whose ``/healthz`` says isolation degraded is refused
        (``SandboxDegraded``) unless the client allows it, and logged as an error either way.
        One that cannot be reached yet is not refused here: every answer is checked too."""
        client = self.client
        try:
            health = await client.health()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("sandbox %s not reachable at start (%s): its isolation is checked on every answer",
                        client.base_url, exc)
            return
        if not health.degraded:
            return
        note = f"isolation degraded: {'; '.join(health.isolation_gaps) or health.isolation}"
        if client.on_degraded is not None:
            client.on_degraded(note, client.allow_degraded)
        if not client.allow_degraded:
            log.error("REFUSING sandbox %s: it runs with %s (model-written code is not fully contained); "
                      "fix the sandbox or set agent.allow_degraded_sandbox: true", client.base_url, note)
            raise SandboxDegraded(f"sandbox {client.base_url} runs with {note}: refused (set "
                                  "agent.allow_degraded_sandbox: true to train on it anyway)")
        log.error("SANDBOX ISOLATION DEGRADED: %s runs with %s; model-written code is not fully contained, "
                  "and it is used because agent.allow_degraded_sandbox is true", client.base_url, note)

    async def open_session(self) -> str:
        return await self.client.open_session()

    async def close_session(self, session_id: str) -> None:
        await self.client.close_session(session_id)

    async def run(self, code: str, session_id: str | None = None) -> ToolResult:
        """Run ``code`` alone, or as the next cell of the live session ``session_id``."""
        answer = await self.client.run(code, session_id)
        if answer.response is None:
            return sandbox_error(answer.error or "unknown", answer.latency_s)
        res = format_run_result(answer.response, self.client.run_timeout_s)
        text, message = res.text, answer.response.message
        if session_id is not None and "ended:" in message:  # the cell ended its session: say so
            text = "\n".join(p for p in (text, f"Sandbox error: {message}") if p)
        return ToolResult(text, res.error, answer.latency_s)

    async def aclose(self) -> None:
        await self.client.aclose()
