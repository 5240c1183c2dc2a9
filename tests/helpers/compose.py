"""Reading deploy/docker-compose*.yml as compose would, for tests that check what it configures."""

from __future__ import annotations

import re


def compose_defaults(text: str) -> str:
    """``${VAR:-default}`` -> ``default`` (what compose interpolates when VAR is unset)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", text)
