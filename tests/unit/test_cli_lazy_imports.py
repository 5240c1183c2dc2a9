"""The ``retool`` CLI starts without torch, transformers or vLLM: they cost 10-30 s of import on
two cores, and ``--help``, ``reward serve``, ``sandbox serve``, ``secrets init`` and the rollout
service's entry point never need them (issue #32). Checked in a fresh interpreter, where nothing
else imported them first."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "vllm")

# the CLI with every sub-command group built, and the modules the light commands import to start
PROBE = """
import json, sys
import typer.main
from services.cli import app
typer.main.get_command(app)
import services.reward.app, services.sandbox.server, services.rollout.runtime, services.stack.secrets
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:]))))
"""


def test_cli_and_light_services_import_no_torch_transformers_or_vllm() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, *HEAVY], capture_output=True, text=True, timeout=240,
                         check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [], f"imported at CLI start: {out}"


def test_the_probe_reports_what_the_cli_imported() -> None:
    """The same probe names a module the CLI does import (the check above can fail)."""
    out = subprocess.run([sys.executable, "-c", PROBE, "typer", *HEAVY], capture_output=True, text=True,
                         timeout=240, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == ["typer"]
