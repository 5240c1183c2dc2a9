"""scripts/gpu-wheels.sh carries every distribution the GPU check imports that a lent GPU machine lacks.

Such a machine has no network: a wheel missing from the list fails the check on the machine, minutes
into a loan. Here the check's import closure is computed in a fresh interpreter, mapped to the
distributions that provide it, and compared with what the machine holds (its image's package list,
docs/gpu-check.md) plus the wheels the script downloads.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The lent machines' image ('cuda', read on 2026-11-17): the distributions the check may import from it.
MACHINE_HAS = {
    "torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet", "numpy", "msgpack",
    "httpx", "httpcore", "h11", "anyio", "idna", "certifi", "sympy", "mpmath", "pyyaml", "rich",
    "pygments", "markdown-it-py", "mdurl", "click", "typer", "tqdm", "prometheus-client", "psutil",
    "packaging", "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "regex", "requests",
    "urllib3", "charset-normalizer", "triton", "pillow", "dill", "setuptools", "shellingham",
    "typing-inspect", "mypy-extensions", "pyarrow", "matplotlib", "contourpy", "cycler", "fonttools",
    "kiwisolver", "pyparsing", "python-dateutil", "six", "uvloop", "xxhash", "aiohttp",
}
# Imported by the check on this machine only through what its environment adds (vLLM's CPU build,
# the dev tools): never on the check's path on a GPU machine.
NOT_ON_GPU_PATH = {"retool", "grpcio-tools", "googleapis-common-protos", "sniffio", "truststore",
                   "httpx2", "httpcore2", "email-validator", "pydantic-extra-types", "python-multipart"}

CLOSURE = r"""
import importlib, importlib.metadata as md, json, sys
before = {k.split('.')[0] for k in sys.modules}
for name in sys.argv[1:]:
    importlib.import_module(name)
import grpc, transformers  # noqa: E401  (imported lazily by the sections)
from transformers import AutoModelForCausalLM  # noqa: F401
dist = md.packages_distributions()
tops = {k.split('.')[0] for k in sys.modules} - before
print(json.dumps(sorted({d for t in tops for d in dist.get(t, [])})))
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _script_wheels() -> set[str]:
    text = (REPO / "scripts" / "gpu-wheels.sh").read_text()
    block = re.search(r"GPU_WHEELS=\((.*?)\)", text, re.S)
    assert block, "scripts/gpu-wheels.sh: no GPU_WHEELS=( ... ) list"
    return {_norm(w) for w in block.group(1).split()}


def _check_modules() -> list[str]:
    """Every services.* / bench.* module the check's sections import (read from their sources)."""
    files = [*sorted((REPO / "bench" / "gpu").glob("*.py")), REPO / "bench" / "engine.py",
             REPO / "bench" / "weights.py", REPO / "bench" / "varlen_attention.py"]
    mods: set[str] = set()
    for f in files:
        mods.update(re.findall(r"^\s*(?:from|import) ((?:services|bench)[\w.]*)", f.read_text(), re.M))
    mods.discard("services.rollout.engine.vllm_engine")  # the check runs without vLLM (its own test)
    return sorted(mods)


def test_wheel_list_covers_the_checks_imports() -> None:
    out = subprocess.run([sys.executable, "-c", CLOSURE, *_check_modules()], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=True)
    needed = {_norm(d) for d in json.loads(out.stdout.strip().splitlines()[-1])}
    present = {_norm(d) for d in MACHINE_HAS | NOT_ON_GPU_PATH}
    missing = needed - present - _script_wheels()
    assert not missing, (f"the GPU check imports {sorted(missing)}, which a lent GPU machine lacks: add them "
                         "to GPU_WHEELS in scripts/gpu-wheels.sh")


def test_wheel_versions_come_from_the_lock() -> None:
    """Every carried wheel is pinned by uv.lock (the check imports what the suite tests)."""
    import tomllib

    lock = {_norm(p["name"]) for p in tomllib.loads((REPO / "uv.lock").read_text())["package"]}
    assert _script_wheels() <= lock, sorted(_script_wheels() - lock)
