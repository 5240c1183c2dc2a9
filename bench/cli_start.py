"""Start time of the ``retool`` CLI: ``--help``, and ``reward serve`` / ``sandbox serve`` to the
first healthy ``/healthz``, for this checkout and a baseline git ref, interleaved in one run.

The baseline is exported with ``git archive`` into a temporary directory and run with the same
interpreter (``PYTHONPATH`` picks the tree), so both sides see the same environment and the same
load. Prints the median per side and the ratio baseline/ours (> 1: ours starts faster).

    python bench/cli_start.py --baseline main --repeats 3
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from services.common.process import free_port, wait_http_healthy

REPO = Path(__file__).resolve().parents[1]

CASES: dict[str, list[str]] = {
    "help": ["--help"],
    "reward serve": ["reward", "serve"],
    "sandbox serve": ["sandbox", "serve", "--set", "zygotes=1", "--set", "light_zygotes=1"],
}


def export_ref(ref: str, dest: Path) -> Path:
    """The tree of ``ref`` under ``dest`` (``git archive``: no worktree, no checkout state), with
    this checkout's virtual environments linked in."""
    blob = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    for venv in (".venv", ".venv-runtime"):  # git-ignored; the sandbox runs code in .venv-runtime
        if (REPO / venv).exists():
            (dest / venv).symlink_to((REPO / venv).resolve())
    return dest


def time_case(tree: Path, args: list[str], timeout_s: float) -> float:
    """Seconds from spawn to exit (``--help``) or to the first healthy ``/healthz`` (serve)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "services.cli", *args]
    serve = "serve" in args
    port = free_port()
    if serve:
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if serve:
            wait_http_healthy(f"http://127.0.0.1:{port}/healthz", timeout_s=timeout_s, proc=proc)
        else:
            if proc.wait(timeout=timeout_s) != 0:
                raise RuntimeError(f"{' '.join(args)} exited {proc.returncode} in {tree}")
        return time.perf_counter() - start
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="main", help="git ref to compare against (default: main)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cli-start-") as tmp:
        sides = {"ours": REPO, opts.baseline: export_ref(opts.baseline, Path(tmp))}
        print(f"{'case':<15} {'side':<12} {'median s':>9} {'runs':>24}")
        for case in opts.cases:
            times: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(opts.repeats):  # interleaved: both sides see the same load
                for side, tree in sides.items():
                    times[side].append(time_case(tree, CASES[case], opts.timeout_s))
            for side, ts in times.items():
                runs = " ".join(f"{t:.2f}" for t in ts)
                print(f"{case:<15} {side:<12} {statistics.median(ts):>9.2f} {runs:>24}")
            ratio = statistics.median(times[opts.baseline]) / statistics.median(times["ours"])
            print(f"{case:<15} ratio {opts.baseline}/ours: {ratio:.2f}x")


if __name__ == "__main__":
    main()
