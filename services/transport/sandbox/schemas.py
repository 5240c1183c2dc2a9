"""The sandbox's HTTP contract: SandboxFusion-compatible request/response models (``/run_code``,
``/run_jupyter``, ``/sessions``) and ``/healthz``.

The sandbox service answers with these models and the rollout's ``SandboxClient`` (``client.py``)
sends and reads them, so the two cannot drift apart. Field names, defaults and status values
follow SandboxFusion so that its clients (verl's sandbox tool) work unchanged: what goes on the
wire is byte for byte what it was before these models moved here. What cannot mean anything is
refused here, with a 422 that names the field; values a drop-in must accept are handled per
field in the service (over-limit timeouts and memory are clamped, see ``services/sandbox/limits``;
each ``fetch_files`` entry is checked on its own at fetch time and reported in ``message`` if
skipped).
"""

from __future__ import annotations

import base64
import binascii
import posixpath
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

ISOLATION_HEADER = "X-Sandbox-Isolation"
"""Set on every HTTP response of a sandbox running under ``isolation: degraded`` (its gaps)."""
PYTHON_ALIASES = frozenset({"python", "python3", "py", "py3"})
MAX_CODE_BYTES = 1024 * 1024


class RunStatus(StrEnum):
    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunStatus(StrEnum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


def check_relative_path(path: str) -> str:
    norm = posixpath.normpath(path)
    if (not path or "\x00" in path or path.startswith("/") or norm == ".."
            or norm.startswith("../") or norm == "."):
        raise ValueError(f"path {path!r} must be relative and stay inside the working directory")
    return norm


def check_files(value: dict[str, str | None]) -> dict[str, str | None]:
    for path, content in value.items():
        check_relative_path(path)
        if content is not None:
            try:
                base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"files[{path!r}] is not valid base64") from None
    return value


class WorkspaceFiles(BaseModel):
    """Files a request puts into the run's working directory and the ones it wants back.

    Invariant: every path is relative and stays inside the working directory, and every
    content is valid base64, before anything runs."""

    files: dict[str, str | None] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list, max_length=1024)

    @field_validator("files")
    @classmethod
    def _files_valid(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        return check_files(value)

    def decoded_files(self) -> dict[str, bytes]:
        return {check_relative_path(p): base64.b64decode(c) if c else b"" for p, c in self.files.items()}


class RunCodeRequest(WorkspaceFiles):
    code: str = Field(..., max_length=MAX_CODE_BYTES)
    language: str = "python"
    compile_timeout: float = Field(10, ge=0)
    run_timeout: float | None = Field(None, gt=0, description="seconds; default from service config")
    memory_limit_MB: int = Field(-1, description="-1 or 0: the service default")
    stdin: str | None = None
    cpu_cores: float | None = Field(None, gt=0, description=(
        "CPU quota of the run in cores (ours); default and maximum: the service's cpu_cores"))
    session_id: str | None = Field(None, max_length=64, description=(
        "run in this live session (POST /sessions): globals persist between calls"))

    @field_validator("language")
    @classmethod
    def _python_only(cls, value: str) -> str:
        if value.lower() not in PYTHON_ALIASES:
            raise ValueError(f"language {value!r} is not supported by this sandbox; "
                             f"use one of {sorted(PYTHON_ALIASES)}")
        return "python"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class SessionCellResponse(RunCodeResponse):
    """``/run_code`` with ``session_id``: SandboxFusion's shape plus the cell's plots (ours)."""

    display: list[dict[str, str]] = Field(default_factory=list, description=(
        "Jupyter display data of the cell's plots (image/png, text/plain)"))


class SessionRequest(BaseModel):
    """``POST /sessions``: open a live interpreter (its limits hold for every cell)."""

    ttl_s: float | None = Field(None, gt=0, description="idle seconds before it is closed; default from "
                                "service config, longer ones are clamped")
    memory_limit_MB: int = Field(-1, description="-1 or 0: the service default")
    cpu_cores: float | None = Field(None, gt=0, description="CPU quota in cores; default and maximum: "
                                    "the service's cpu_cores")


class SessionResponse(BaseModel):
    session_id: str
    ttl_s: float
    memory_limit_MB: int
    message: str = ""


class RunJupyterRequest(WorkspaceFiles):
    """SandboxFusion's ``/run_jupyter`` request; ``session_id`` (ours) runs the cells in a live
    session instead of a fresh one, so earlier cells need not be sent again."""

    cells: list[str] = Field(..., min_length=1, max_length=256)
    cell_timeout: float = Field(0, ge=0, description="seconds per cell; 0: only total_timeout (and the "
                                "service's max_run_timeout_s) bound a cell")
    total_timeout: float = Field(45, gt=0, description="seconds for all cells")
    kernel: str = "python3"
    memory_limit_MB: int = Field(-1, description="-1 or 0: the service default")
    cpu_cores: float | None = Field(None, gt=0, description="CPU quota in cores (ours); default and "
                                    "maximum: the service's cpu_cores")
    session_id: str | None = Field(None, max_length=64)

    @field_validator("kernel")
    @classmethod
    def _python_kernel(cls, value: str) -> str:
        if value not in ("python3", "python"):
            raise ValueError(f"kernel {value!r} is not supported; use 'python3'")
        return "python3"

    @field_validator("cells")
    @classmethod
    def _cells_small(cls, value: list[str]) -> list[str]:
        if sum(len(c) for c in value) > MAX_CODE_BYTES:
            raise ValueError(f"cells hold more than {MAX_CODE_BYTES} characters together")
        return value


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]] = Field(default_factory=list)
    error: list[dict[str, Any]] = Field(default_factory=list)


class RunJupyterResponse(BaseModel):
    status: RunStatus
    message: str = ""
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)
    executor_pod_name: str | None = None


class SandboxHealth(BaseModel):
    """``GET /healthz``. ``isolation`` is ``"ok"`` only when every isolation layer holds; under
    ``isolation: degraded`` with a layer missing it is ``"degraded"`` and ``isolation_gaps`` lists
    what is missing. Extra fields are kept (a newer sandbox may say more)."""

    model_config = ConfigDict(extra="allow")

    status: str
    isolation: str = "ok"
    isolation_gaps: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    @property
    def degraded(self) -> bool:
        return self.isolation != "ok"
