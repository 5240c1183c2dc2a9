"""The runs' declared Python environment: the math stack model code expects, separate from
the service's own, warm where it is heavy, and usable when it lives under /tmp (which each
run covers with its own tmpfs)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from services.sandbox.launcher import SandboxProcess
from services.sandbox.runtime_env import DEFAULT_RUNTIME
from tests.integration.sandbox_client import run_code, stderr_of, stdout_of

pytestmark = pytest.mark.integration


def test_runs_get_the_math_stack_and_nothing_of_the_service(sandbox_url):
    runtime = httpx.get(f"{sandbox_url}/healthz", timeout=10).json()["runtime"]
    assert runtime["python"] != sys.executable and runtime["preload_failed"] == []
    code = """
import importlib.util, sys
mods = ["numpy", "sympy", "mpmath", "scipy", "pandas", "networkx", "scipy.optimize", "scipy.special"]
print([m for m in mods if importlib.util.find_spec(m) is None])
print([m for m in ("torch", "fastapi", "transformers") if importlib.util.find_spec(m) is not None])
print(sys.executable)
"""
    missing, service_only, executable = stdout_of(run_code(sandbox_url, code)).splitlines()
    assert missing == "[]" and service_only == "[]"
    assert executable == runtime["python"]
    r = run_code(sandbox_url, "import subprocess\nsubprocess.run(['python', '-c', 'import scipy, sys; "
                              "print(sys.executable)'], check=True)")
    assert stdout_of(r).strip() == runtime["python"], r  # `python` on PATH is the runtime's too


def test_heavy_imports_are_warm_where_the_code_needs_them(sandbox_url):
    heavy = ("import sys\nwarm = [m in sys.modules for m in ('pandas', 'scipy.optimize', 'networkx')]\n"
             "import pandas as pd, scipy.optimize as so, networkx as nx\n"
             "print(warm, round(so.brentq(lambda t: t * t - 2, 0, 2), 6), int(pd.Series([1, 2]).sum()),"
             " nx.shortest_path_length(nx.path_graph(5), 0, 4))")
    assert stdout_of(run_code(sandbox_url, heavy)) == "[True, True, True] 1.414214 3 4\n"
    math = "import sys\nprint('sympy' in sys.modules, 'pandas' in sys.modules)\nimport sympy"
    assert stdout_of(run_code(sandbox_url, math)) == "True False\n"  # the cheaper fork for sympy code
    plain = "import sys\nprint('numpy' in sys.modules)"
    assert stdout_of(run_code(sandbox_url, plain)) == "False\n"  # and the cheapest for plain code


def test_a_runtime_under_tmp_stays_importable_in_runs(tmp_path):
    """Each run mounts its own /tmp: a runtime living there must be bound back into it."""
    assert str(tmp_path).startswith("/tmp/")
    base = str(DEFAULT_RUNTIME) if DEFAULT_RUNTIME.exists() else sys.executable
    venv = tmp_path / "rt"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    base_site = subprocess.run([base, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip()
    (site / "base-runtime.pth").write_text(base_site + "\n")  # numpy, msgpack, ... from the real runtime
    (site / "tmp_probe_mod.py").write_text("VALUE = 42\n")  # never preloaded: read from /tmp at run time
    args = ["--set", f"runtime_python={venv}/bin/python", "--set", "max_concurrency=2", "--set", "zygotes=1",
            "--set", "light_zygotes=0", "--set", "heavy_zygotes=0"]
    with SandboxProcess(args, log_path=str(tmp_path / "sb.log")) as sb:
        code = ("import subprocess, sys, tmp_probe_mod\n"
                "print(tmp_probe_mod.VALUE, sys.executable, flush=True)\n"
                "subprocess.run([sys.executable, '-c',\n"
                "                'import tmp_probe_mod; print(tmp_probe_mod.VALUE + 1)'], check=True)\n"
                "try:\n    open(tmp_probe_mod.__file__, 'a')\n"
                "except OSError as exc:\n    print('not writable', exc.errno in (13, 30))\n"
                "open('/tmp/scratch.txt', 'w').write('the run still owns /tmp')\nprint('ok')")
        r = run_code(sb.url, code)
        assert r["status"] == "Success", (r, stderr_of(r))
        assert stdout_of(r) == f"42 {venv}/bin/python\n43\nnot writable True\nok\n"
