"""The runs' Python environment: which interpreter the zygotes run, and what it may import.

Runs get a declared environment of their own (``runtime_python``: a venv or prefix holding
numpy, sympy, mpmath, scipy, pandas, networkx, ... and msgpack for the zygote protocol; see
``runtime-requirements.txt``), separate from the service's. Invariant: the zygote's
``sys.path`` is that environment plus a directory holding nothing but this ``services``
package, so nothing of the service's own environment is importable in a run.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from services.common.config import ConfigError
from services.common.logging import get_logger

log = get_logger("sandbox.runtime")

SERVICES_DIR = Path(__file__).resolve().parents[1]  # .../services
PACKAGE_ROOT = SERVICES_DIR.parent
DEFAULT_RUNTIME = PACKAGE_ROOT / ".venv-runtime" / "bin" / "python"
REQUIREMENTS = Path(__file__).with_name("runtime-requirements.lock")  # from runtime-requirements.txt


def resolve_runtime_python(setting: str) -> str:
    """The interpreter for the zygotes; ``auto`` prefers ``.venv-runtime`` beside the package."""
    if setting != "auto":
        if not (os.path.isfile(setting) and os.access(setting, os.X_OK)):
            raise ConfigError(f"runtime_python {setting!r} is not an executable file; build it with `python "
                              f"-m venv DIR && DIR/bin/pip install --require-hashes -r {REQUIREMENTS}`")
        return setting
    if os.access(DEFAULT_RUNTIME, os.X_OK):
        return str(DEFAULT_RUNTIME)
    log.warning("no run-time environment at %s (make install builds it): runs use the service's "
                "interpreter, without scipy/pandas/networkx unless it has them", DEFAULT_RUNTIME)
    return sys.executable


def stage_package() -> str:
    """A directory whose only entry is this ``services`` package: the zygotes' ``PYTHONPATH``."""
    stage = tempfile.mkdtemp(prefix="retool-sandbox-pkg-")
    os.chmod(stage, 0o755)
    os.symlink(SERVICES_DIR, os.path.join(stage, "services"))
    return stage
