"""Run ``retool demo`` as a user does: the real CLI in its own process, with a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


def run_demo(*args: str, timeout_s: float, env: dict[str, str] | None = None) -> tuple[str, str]:
    """``retool demo ARGS`` to completion: (stdout, stderr). Past ``timeout_s`` it gets SIGTERM (the
    demo stops its services on SIGTERM) and the test fails with the tail of its stderr; a non-zero
    exit fails the test too."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "demo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"demo {' '.join(args)} exceeded {timeout_s:.0f} s:\n{stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    return stdout, stderr
