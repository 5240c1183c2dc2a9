"""The GPU check: ``python -m bench.gpu`` (or ``scripts/gpu-check.sh``); see docs/gpu-check.md.

Runs the sections (environment, trainer, packing, engine, weights) one after the other, each in
its own process group with a time budget, within an overall deadline (default 570 s: one 10-minute
GPU loan with room to start), and writes ``gpu-report.json`` and ``gpu-report.md`` to ``--out``.

Invariants:
- a section that fails, hangs or crashes (a CUDA error poisons only its own process) is recorded
  with its error, its budget and what it saved, and the next section runs;
- a section gets ``min(its budget, time left before the deadline)``; with under 10 s left it is
  ``skipped``; everything a section started is killed with its process group;
- the report is written after every section, so even a check killed from outside leaves one;
- exit status 0 only when every section is ``ok``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu.report import SECTIONS, Report, SectionReport, markdown, validated

ROOT = Path(__file__).resolve().parents[2]
BUDGETS_S = {
    "cuda": {"env": 45, "trainer": 180, "packing": 100, "engine": 90, "weights": 150},
    "cpu": {"env": 60, "trainer": 240, "packing": 120, "engine": 120, "weights": 180},
}
MIN_SECTION_S = 10.0


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_section(name: str, device: str, work: Path, budget_s: float, log: Path) -> SectionReport:
    out = work / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu.section",
        name,
        "--device",
        device,
        "--work",
        str(work / name),
        "--out",
        str(out),
        "--deadline",
        str(time.time() + budget_s),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    start = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(proc.pid)  # the section's children too (torchrun, its worker, the replica)
            proc.wait()
    seconds = time.monotonic() - start
    results = json.loads(out.read_text()) if out.exists() else {}
    err_file = out.with_suffix(".error")
    if rc is None:
        status, error = "timeout", f"killed at its budget of {budget_s:.0f} s"
    elif rc == 0:
        status, error = "ok", None
    else:
        status = "error"
        if err_file.exists():
            error = json.loads(err_file.read_text())["error"]
        else:
            tail = log.read_text(errors="replace").strip().splitlines()[-20:]
            error = f"exit status {rc}:\n" + "\n".join(tail)
    return validated(
        SectionReport(
            name=name,
            status=status,
            seconds=round(seconds, 2),
            budget_s=budget_s,
            error=error,
            results=results,
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda: the real check; cpu: the same sections on small sizes (CI); auto: cuda if present",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="report directory")
    ap.add_argument("--deadline-s", type=float, default=570.0, help="overall wall-clock limit")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--budget", action="append", default=[], metavar="SECTION=S", help="override a budget")
    args = ap.parse_args(argv)
    device = args.device
    if device != "cpu":
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device (use --device cpu)")
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    budgets = dict(BUDGETS_S[device])
    for item in args.budget:
        name, _, secs = item.partition("=")
        if name not in budgets or not secs.replace(".", "", 1).isdigit():
            ap.error(f"--budget {item!r}: expected SECTION=SECONDS with SECTION in {list(SECTIONS)}")
        budgets[name] = float(secs)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    start = time.monotonic()
    sections: list[SectionReport] = []
    report = None
    for name in SECTIONS:
        left = args.deadline_s - (time.monotonic() - start) - 5  # 5 s to write the report
        if name not in chosen:
            sections.append(
                SectionReport(
                    name=name, status="skipped", seconds=0, budget_s=0, error="not selected (--sections)"
                )
            )
        elif left < MIN_SECTION_S:
            sections.append(
                SectionReport(
                    name=name,
                    status="skipped",
                    seconds=0,
                    budget_s=0,
                    error=f"the overall deadline of {args.deadline_s:.0f} s left {max(left, 0):.0f} s",
                )
            )
        else:
            budget = min(budgets[name], left)
            print(f"[gpu-check] {name}: up to {budget:.0f} s", flush=True)
            sections.append(run_section(name, device, work, budget, args.out / f"{name}.log"))
            s = sections[-1]
            print(
                f"[gpu-check] {name}: {s.status} in {s.seconds:.0f} s"
                + (f": {s.error.splitlines()[0][:200]}" if s.error else ""),
                flush=True,
            )
        report = Report(
            created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            device=device,
            command=shlex.join(["python", "-m", "bench.gpu", *(argv if argv is not None else sys.argv[1:])]),
            deadline_s=args.deadline_s,
            total_seconds=round(time.monotonic() - start, 1),
            sections=sections
            + [
                SectionReport(name=n, status="skipped", seconds=0, budget_s=0, error="not reached yet")
                for n in SECTIONS[len(sections) :]
            ],
        )
        (args.out / "gpu-report.json").write_text(report.model_dump_json(indent=2))
        (args.out / "gpu-report.md").write_text(markdown(report))
    assert report is not None
    print(markdown(report))
    print(f"[gpu-check] report: {args.out / 'gpu-report.json'} and {args.out / 'gpu-report.md'}")
    return 0 if all(s.status == "ok" for s in report.sections if s.name in chosen) else 1


if __name__ == "__main__":
    raise SystemExit(main())
