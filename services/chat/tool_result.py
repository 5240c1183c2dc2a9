"""What the model sees of one code-tool call: a sandbox answer rendered as text.

Invariants: ``format_run_result`` is the one place a ``/run_code`` answer becomes tool text (stdout,
then stderr, then the failure if any), so the rollout agent and the SFT traces written for the
demo show the model exactly the same text for the same run; everything that is not a clean
``Success`` with exit code 0 is an error (``ToolResult.error``).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.transport.sandbox.schemas import CommandRunStatus, RunCodeResponse, RunStatus


@dataclass(frozen=True)
class ToolResult:
    text: str
    error: bool
    latency_s: float = 0.0


def sandbox_error(reason: str, latency_s: float = 0.0) -> ToolResult:
    """A failure the sandbox reported instead of a run (HTTP status, a session that ended)."""
    return ToolResult(f"Sandbox error: {reason}", True, latency_s)


def format_run_result(response: RunCodeResponse, run_timeout_s: float) -> ToolResult:
    """SandboxFusion answer -> what the model sees (stdout, then stderr, then the failure if any)."""
    status, run = response.status, response.run_result
    stdout = (run.stdout if run else None) or ""
    stderr = (run.stderr if run else None) or ""
    parts = [p for p in (stdout, stderr) if p]
    error = status != RunStatus.Success
    if run is not None and run.status == CommandRunStatus.TimeLimitExceeded:
        parts.append(f"TimeoutError: execution exceeded {run_timeout_s:g} seconds")
        error = True
    elif status == RunStatus.SandboxError or (run is None and status != RunStatus.Success):
        parts.append(f"Sandbox error: {response.message or status.value}")
        error = True
    elif run is not None and run.return_code not in (0, None):
        error = True
        if not stderr:
            parts.append(f"Process exited with code {run.return_code}")
    return ToolResult("\n".join(p.rstrip("\n") for p in parts), error)
