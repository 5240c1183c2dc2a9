"""Section 2, trainer: ``bench.gpu.trainer_worker`` as one rank under torchrun (FSDP2 on NCCL on a
GPU, gloo on the CPU); its JSON is this section's result.

Invariant: the worker gets the section's deadline and saves after every run, so a worker killed at
the budget still leaves the runs it finished (this section then records them with the timeout).
"""

from __future__ import annotations

import json
import os
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
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, ctx.left())
    )
    if out.exists():
        ctx.save(**json.loads(out.read_text()))
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{tail}")
