"""Section 2, trainer: ``bench.gpu.trainer_worker`` as one rank under torchrun (FSDP2 on NCCL on a
GPU, gloo on the CPU); its JSON is this section's result.

Invariants: the worker gets the section's deadline (minus 5 s), saves after every run and exits
hard at its deadline (it lives in a session of torchrun's, out of reach of the process-group kill),
so it never holds the GPU into the next section; a failed reference or run makes the section an
``error`` that keeps everything measured.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.gpu.common import Ctx

ROOT = Path(__file__).resolve().parents[2]


def run(ctx: Ctx) -> None:
    out = ctx.work / "trainer-worker.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "bench.gpu.trainer_worker",
        "--device",
        ctx.device,
        "--out",
        str(out),
        "--deadline",
        str(ctx.deadline - 5),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2)))),
    }
    ctx.save(
        command=f"torchrun --standalone --nproc_per_node 1 -m bench.gpu.trainer_worker --device {ctx.device}"
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        log, _ = proc.communicate(timeout=max(1.0, ctx.left() - 2))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its worker (another session)
        log, _ = proc.communicate()
    if out.exists():
        ctx.save(**json.loads(out.read_text()))
    if proc.returncode != 0:
        tail = "\n".join(log.strip().splitlines()[-25:])
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{tail}")
    failed = [r for r in ctx.results.get("runs", []) if "error" in r]
    if "error" in ctx.results.get("reference", {}) or failed:
        raise RuntimeError(f"reference: {ctx.results['reference'].get('error')}; runs failed: {failed}")
