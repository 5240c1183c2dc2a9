"""The one shape of every error answer our HTTP services send, and its OpenAPI declaration.

Invariants
- Every error body is ``{"detail": ...}``. A 422 is FastAPI's own validation shape,
  ``{"detail": [{"loc": [...], "msg": "...", "type": "..."}]}``, whether FastAPI or our code found
  the problem (``field_error``: the field is in ``loc``); every other 4xx/5xx is
  ``{"detail": "<what went wrong and what to do>"}`` (``ApiError``, sent by ``error``).
- ``responses(...)`` declares those statuses on a route with their body model, so a client
  generated from ``/openapi.json`` can read every answer a route gives (checked by schemathesis
  in tests/integration/test_openapi_conformance.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field


class ApiError(BaseModel):
    """Every error answer other than 422."""

    detail: str = Field(description="what went wrong, naming the field or limit, and what to do")


class FieldError(BaseModel):
    """One item of a 422: FastAPI's ``ValidationError`` (``input``/``ctx`` may come along)."""

    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    detail: list[FieldError]


DESCRIPTIONS = {
    400: "the body could not be parsed (not UTF-8 JSON)",
    401: "missing or wrong bearer token (when the service has one)",
    404: "unknown id",
    410: "the session ended (the detail says why)",
    429: "at capacity: retry after Retry-After seconds",
    502: "a service this one called failed",
    503: "not able to serve now (overloaded or a part is down): retry after Retry-After seconds",
    504: "queue full or waited too long for a slot: retry after Retry-After seconds",
}


def responses(*statuses: int,
              descriptions: Mapping[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for these error statuses (``ApiError`` bodies; 422: FastAPI's shape)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        text = (descriptions or {}).get(status) or DESCRIPTIONS.get(status, "error")
        model = ValidationErrorBody if status == 422 else ApiError
        out[status] = {"model": model, "description": text}
    return out


def error(status: int, detail: str, *, retry_after: int | float | None = None) -> JSONResponse:
    """An ``ApiError`` answer (never for 422: use ``field_error``)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def field_error(loc: list[str | int], msg: str) -> JSONResponse:
    """A 422 in FastAPI's own shape: ``loc`` names the field, ``msg`` the limit."""
    return JSONResponse({"detail": [{"type": "value_error", "loc": loc, "msg": msg}]}, status_code=422)
