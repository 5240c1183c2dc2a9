"""One rank of a 2-process gloo group for FSDP tests spawned with ``torch.multiprocessing``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[None]:
    """Join the group for the body; after it, meet the other ranks and leave the process.

    On success the process exits with ``os._exit(0)``, skipping gloo's C++ teardown: under
    load it sometimes aborts ("terminate called without an active exception") after all work
    is done, failing a correct run. On an error the group is destroyed and the error raised.
    """
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()  # every rank is done with every collective
    except BaseException:
        dist.destroy_process_group()
        raise
    sys.stdout.flush()
    os._exit(0)
