"""Sandbox and reward services as local child processes, for jobs that run the pipeline on one
machine (``retool demo``, ``retool eval`` without URLs).

Invariant: every process started here is registered on the caller's ``ExitStack``, so leaving
the stack (normally, on error, on Ctrl-C or, under ``run_interruptible``, on SIGTERM) stops them all.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import typer

from services.common.process import ServiceProcess
from services.sandbox.launcher import SandboxProcess

T = TypeVar("T")


def run_interruptible(job: Callable[[], T]) -> T:
    """Run a CLI job; SIGTERM unwinds like Ctrl-C (every ``ExitStack`` stops its children) and
    either one ends the command with exit code 130."""

    def _terminate(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        return job()
    except KeyboardInterrupt:
        print("interrupted: all services stopped", file=sys.stderr)
        raise typer.Exit(130) from None


def start_tool_services(stack: contextlib.ExitStack, logs: Path, *, sandbox_concurrency: int = 16
                        ) -> tuple[str, str]:
    """Start the sandbox and the reward service; return their URLs ``(sandbox, reward)``."""
    logs.mkdir(parents=True, exist_ok=True)
    sandbox = stack.enter_context(SandboxProcess(
        ["--set", f"max_concurrency={sandbox_concurrency}", "--set", "zygotes=1", "--set", "light_zygotes=1"],
        log_path=str(logs / "sandbox.log")))
    print(f"sandbox  {sandbox.url}", file=sys.stderr)
    reward = stack.enter_context(ServiceProcess(["reward", "serve", "--set", "workers=1"],
                                                log_path=logs / "reward.log"))
    print(f"reward   {reward.url}", file=sys.stderr)
    return sandbox.url, reward.url
