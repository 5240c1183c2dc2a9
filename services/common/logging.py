"""Structured (JSON-lines) logging for every service.

Invariant: one JSON object per line on stderr; values under keys that look like secrets are
redacted before they are written.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_SECRET_HINTS = ("token", "secret", "password", "api_key", "authorization")
_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


def _redact(key: str, value: Any) -> Any:
    return "***" if any(h in key.lower() for h in _SECRET_HINTS) else value


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                payload[key] = _redact(key, value)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def setup_logging(level: str = "INFO", *, json_format: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_format else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
