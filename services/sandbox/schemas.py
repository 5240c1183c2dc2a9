"""SandboxFusion-compatible request/response models for ``POST /run_code``.

Field names, defaults and status values follow SandboxFusion so that its clients (verl's
sandbox tool) work unchanged. What cannot mean anything is refused here, with a 422 that
names the field; values a drop-in must accept are handled per field elsewhere (over-limit
timeouts and memory are clamped, see ``limits``; each ``fetch_files`` entry is checked
on its own at fetch time and reported in ``message`` if skipped).
"""

from __future__ import annotations

import base64
import binascii
import posixpath
from enum import StrEnum

from pydantic import BaseModel, Field, field_validator

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


class RunCodeRequest(BaseModel):
    code: str = Field(..., max_length=MAX_CODE_BYTES)
    language: str = "python"
    compile_timeout: float = Field(10, ge=0)
    run_timeout: float | None = Field(None, gt=0, description="seconds; default from service config")
    memory_limit_MB: int = Field(-1, description="-1 or 0: the service default")
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list, max_length=1024)

    @field_validator("language")
    @classmethod
    def _python_only(cls, value: str) -> str:
        if value.lower() not in PYTHON_ALIASES:
            raise ValueError(f"language {value!r} is not supported by this sandbox; "
                             f"use one of {sorted(PYTHON_ALIASES)}")
        return "python"

    @field_validator("files")
    @classmethod
    def _files_valid(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        for path, content in value.items():
            check_relative_path(path)
            if content is not None:
                try:
                    base64.b64decode(content, validate=True)
                except (binascii.Error, ValueError):
                    raise ValueError(f"files[{path!r}] is not valid base64") from None
        return value

    def decoded_files(self) -> dict[str, bytes]:
        return {check_relative_path(p): base64.b64decode(c) if c else b"" for p, c in self.files.items()}


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
