"""One section of the GPU check in its own process: ``python -m bench.gpu.section NAME ...``.

Invariants: the section's results file holds what it measured so far (``Ctx.save``); on an
exception the process writes the error (type, message, the last frames) beside them and exits 1;
it never outlives its deadline by choice (the orchestrator kills its process group at the budget).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import traceback
from pathlib import Path

from bench.gpu.common import SIZES, Ctx
from bench.gpu.report import SECTIONS

FAULT_ENV = "RETOOL_GPU_CHECK_FAULT"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name", choices=SECTIONS)
    ap.add_argument("--device", choices=sorted(SIZES), required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, required=True, help="time.time() to be done by")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args.device, args.work, args.out, args.deadline)
    try:
        if os.environ.get(FAULT_ENV) == args.name:  # fault injection (tests): this section fails
            raise RuntimeError(f"fault injected by {FAULT_ENV}={args.name}")
        importlib.import_module(f"bench.gpu.{args.name}").run(ctx)
    except BaseException as exc:
        tb = "".join(traceback.format_exception(exc)[-6:])
        args.out.with_suffix(".error").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}\n{tb}"}))
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
