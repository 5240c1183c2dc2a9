"""Per-request limits, resolved against the service's configuration the way a drop-in must.

SandboxFusion accepts any ``run_timeout`` and ``memory_limit_MB``; refusing values above our
maxima would turn every call of a client configured a little higher into a failure, so
they are clamped and the response says so (``message`` and the ``X-Sandbox-Notes`` header).
Values that cannot mean anything (negative timeouts, bad paths or base64 in ``files``) are
still refused with a 422 by the request schema.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.sandbox.config import SandboxConfig
from services.transport.sandbox.schemas import RunCodeRequest

# verl's client reads for compile_timeout + run_timeout + 10 s; a request that waited for a
# slot longer than compile_timeout + this would be answered after the client gave up.
QUEUE_SLACK_S = 5.0


@dataclass(frozen=True)
class RunLimits:
    timeout_s: float
    memory_mb: int
    stack_mb: int
    notes: tuple[str, ...] = ()
    cpu_cores: float = 1.0


def resolve_limits(req: RunCodeRequest, cfg: SandboxConfig) -> RunLimits:
    notes = []
    timeout = req.run_timeout if req.run_timeout is not None else cfg.default_run_timeout_s
    if timeout > cfg.max_run_timeout_s:
        notes.append(f"run_timeout {timeout:g} s clamped to the maximum {cfg.max_run_timeout_s:g} s")
        timeout = cfg.max_run_timeout_s
    memory = req.memory_limit_MB if req.memory_limit_MB > 0 else cfg.default_memory_mb
    if memory > cfg.max_memory_mb:
        notes.append(f"memory_limit_MB {memory} clamped to the maximum {cfg.max_memory_mb}")
        memory = cfg.max_memory_mb
    cores = clamp_cpu(req.cpu_cores, cfg, notes)
    return RunLimits(timeout, memory, cfg.stack_mb_for(memory), tuple(notes), cores)


def clamp_cpu(requested: float | None, cfg: SandboxConfig, notes: list[str]) -> float:
    """A run's CPU quota: the request's, at most ``cpu_cores`` (the default)."""
    if requested is None:
        return cfg.cpu_cores
    if requested > cfg.cpu_cores:
        notes.append(f"cpu_cores {requested:g} clamped to the maximum {cfg.cpu_cores:g}")
        return cfg.cpu_cores
    return requested


def queue_wait_s(req: RunCodeRequest, cfg: SandboxConfig) -> float:
    """Longest time this request may wait for a slot before it is answered 504."""
    return min(cfg.queue_timeout_s, req.compile_timeout + QUEUE_SLACK_S)
