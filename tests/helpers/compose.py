"""Reading deploy/docker-compose*.yml as compose would, for tests that check what it configures."""

from __future__ import annotations

import re


def compose_defaults(text: str) -> str:
    """``${VAR:-default}`` -> ``default`` (what compose interpolates when VAR is unset)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", text)


DRAIN_MARGIN_S = 15.0  # past drain_s: the hand-back, the engine's and the server's shutdown


def rollout_drain_s(args: list[str], env: dict[str, str] | None = None) -> float:
    """The ``redis.drain_s`` a ``retool rollout serve`` command line (``--set``) and environment give."""
    from services.rollout.config import RedisWorkerConfig

    value: object = RedisWorkerConfig.model_fields["drain_s"].default
    for key, val in (env or {}).items():
        if key.upper() == "RETOOL_ROLLOUT__REDIS__DRAIN_S":
            value = val
    for a, b in zip(args, args[1:], strict=False):
        if a == "--set" and b.startswith("redis.drain_s="):
            value = b.split("=", 1)[1]
    return float(str(value))


def duration_s(text: str | int) -> float:
    """A compose duration (``60s``, ``1m30s``) or a number of seconds."""
    if isinstance(text, int):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a compose duration: {text!r}")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)
