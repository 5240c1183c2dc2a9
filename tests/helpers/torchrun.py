"""Launching ``retool`` commands under torchrun in tests: 2 local processes on a free port."""

from __future__ import annotations

import os
import sys

from services.common.process import free_port


def torchrun_cmd(*cli_args: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run ... -m services.cli CLI_ARGS`` on a free master port."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", "-m", "services.cli", *cli_args]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This environment, one OpenMP thread per rank (two ranks share the cores), and ``extra``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}
