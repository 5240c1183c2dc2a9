"""Refuse to start without the privileges the per-run isolation needs (fail closed)."""

from __future__ import annotations

import os

from services.common.config import ConfigError
from services.sandbox.config import SandboxConfig


def check_isolation_available(cfg: SandboxConfig) -> None:
    if not cfg.require_isolation:
        return
    if os.geteuid() != 0:
        raise ConfigError(
            "the sandbox needs root inside its container (capabilities SYS_ADMIN for namespaces and "
            "mounts, SETUID/SETGID to drop each run to its own uid); it runs the model's code as "
            f"uid {cfg.uid_base}+slot, never as root. Current euid is {os.geteuid()}.")
    top = cfg.uid_base + cfg.max_concurrency
    if top > 2**31 - 2:
        raise ConfigError(f"uid_base + max_concurrency = {top} is not a valid uid range")
