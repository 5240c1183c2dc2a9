"""Sandbox service configuration (one validated model; env prefix ``RETOOL_SANDBOX``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import StrictModel
from services.common.security import ServerSecurity

LIGHT_PRELOAD = (
    "math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "random",
    "statistics", "re", "json", "heapq", "bisect", "string", "operator",
)

DEFAULT_PRELOAD = (*LIGHT_PRELOAD, "numbers", "numpy", "sympy", "mpmath")

HEAVY_PRELOAD = (
    *DEFAULT_PRELOAD, "scipy", "scipy.special", "scipy.optimize", "scipy.linalg", "scipy.integrate",
    "scipy.interpolate", "scipy.stats", "pandas", "networkx", "matplotlib", "matplotlib.pyplot",
)

MAX_OUTPUT_CAP = 1024 * 1024  # SandboxFusion returns at most 1 MB of each stream


class SandboxConfig(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    log_level: str = "INFO"

    max_concurrency: int = Field(128, ge=1, le=4096, description="executions running at once")
    max_queue: int = Field(1024, ge=0, description="requests waiting for a slot; beyond -> 504 at once")
    queue_timeout_s: float = Field(30.0, gt=0, description=(
        "longest wait for a slot before 504 (which verl's client retries); a request also waits "
        "at most its compile_timeout + 5 s, so that the answer comes within verl's read timeout "
        "(compile_timeout + run_timeout + 10 s)"))

    default_memory_mb: int = Field(1024, ge=16)
    max_memory_mb: int = Field(4096, ge=16, description="larger requests are clamped (and told so)")
    default_run_timeout_s: float = Field(10.0, gt=0)
    max_run_timeout_s: float = Field(60.0, gt=0, description="longer requests are clamped (and told so)")
    stack_limit_mb: int = Field(0, ge=0, description=(
        "stack of a run's main thread; 0 = the run's memory limit (as SandboxFusion sets it)"))
    max_output_bytes: int = Field(MAX_OUTPUT_CAP, ge=64, le=MAX_OUTPUT_CAP,
                                  description="per stream (stdout, stderr); head and tail kept")
    max_processes: int = Field(32, ge=1, description="processes/threads one run may have at once")
    workdir_size_mb: int = Field(64, ge=1, description="size of each run's private tmpfs")
    max_fetch_file_bytes: int = Field(8 * 1024 * 1024, ge=0)

    runtime_python: str = Field("auto", description=(
        "interpreter of the runs' Python environment (numpy, sympy, scipy, pandas, networkx, ...), "
        "separate from the service's own; 'auto' = .venv-runtime/bin/python beside the package "
        "if it exists, else the service's interpreter (with a warning)"))
    preload_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_PRELOAD))
    zygotes: int = Field(2, ge=1, le=64, description="warm fork servers with preload_modules")
    light_zygotes: int = Field(2, ge=0, le=64, description="warm fork servers with only the standard "
                               "library, for code that imports nothing else (cheaper fork); 0 = off")
    light_preload_modules: list[str] = Field(default_factory=lambda: list(LIGHT_PRELOAD))
    heavy_zygotes: int = Field(1, ge=0, le=64, description="warm fork servers that also hold scipy, "
                               "pandas, networkx (dearer fork, used only by code importing them); 0 = off")
    heavy_preload_modules: list[str] = Field(default_factory=lambda: list(HEAVY_PRELOAD))
    uid_base: int = Field(61000, ge=1000, description="run i uses uid/gid uid_base + slot")
    cpu_cores: float = Field(1.0, gt=0, le=256, description=(
        "CPU quota of one run (its cgroup's cpu controller); a request may ask for less"))
    use_cgroups: bool = Field(True, description="per-run cgroup for total memory/pids/CPU (off only "
                              "with isolation: degraded)")
    cgroup_slack_mb: int = Field(256, ge=0, description="cgroup memory beyond memory limit + tmpfs, for "
                                 "pages a run copies from its zygote")
    max_sessions: int = Field(16, ge=0, le=4096, description=(
        "live interpreter sessions at once (POST /sessions); beyond -> 429; 0 = sessions off"))
    session_idle_ttl_s: float = Field(300.0, gt=0, description="a session idle this long is closed")
    max_session_idle_ttl_s: float = Field(3600.0, gt=0, description="longer requested TTLs are clamped")
    session_max_lifetime_s: float = Field(7200.0, gt=0, description="a session ends this long after it "
                                          "opened, however busy")
    security: ServerSecurity = Field(default_factory=ServerSecurity, description=(
        "bearer token (and optional TLS) every route but /healthz and /metrics requires"))
    isolation: Literal["strict", "degraded"] = Field("strict", description=(
        "strict: refuse to start unless every layer holds (root, namespaces, the minimal root, "
        "memory/pids/CPU cgroups, the syscall filter, an empty capability bounding set); degraded: "
        "start without the cgroups, the filter or the bounding-set drop where they are unavailable, "
        "and say so in /healthz and in every response"))

    @model_validator(mode="after")
    def _limits_consistent(self) -> SandboxConfig:
        if self.default_memory_mb > self.max_memory_mb:
            raise ValueError(f"default_memory_mb ({self.default_memory_mb}) exceeds max_memory_mb "
                             f"({self.max_memory_mb})")
        if self.default_run_timeout_s > self.max_run_timeout_s:
            raise ValueError(f"default_run_timeout_s ({self.default_run_timeout_s}) exceeds "
                             f"max_run_timeout_s ({self.max_run_timeout_s})")
        if self.session_idle_ttl_s > self.max_session_idle_ttl_s:
            raise ValueError(f"session_idle_ttl_s ({self.session_idle_ttl_s}) exceeds "
                             f"max_session_idle_ttl_s ({self.max_session_idle_ttl_s})")
        if not self.use_cgroups and self.isolation == "strict":
            raise ValueError("use_cgroups=false leaves runs without memory/pids/CPU limits: it needs "
                             "isolation: degraded")
        if self.uid_base + self.max_concurrency + self.max_sessions > 65534:
            raise ValueError(f"uid_base + max_concurrency + max_sessions must stay below 65534 (runs use "
                             f"uids from uid_base={self.uid_base}, then one per slot and per session)")
        return self

    @property
    def max_stack_mb(self) -> int:
        """The largest stack any run may get: the zygotes are started with this stack limit."""
        return self.stack_limit_mb or self.max_memory_mb

    def stack_mb_for(self, memory_mb: int) -> int:
        return min(self.stack_limit_mb, memory_mb) if self.stack_limit_mb else memory_mb
