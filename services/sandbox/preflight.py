"""Refuse to start without what the per-run isolation needs (fail closed).

The rest of fail-closed lives where each layer is set up: the executor refuses to start
without memory/pids/cpu cgroups, each zygote without its filter, bounding-set drop and
minimal root, unless ``isolation: degraded`` (``executor``, ``zygote``).

Capabilities the service needs inside its container (all others can be dropped), and why:

- ``SYS_ADMIN``: create each run's mount/pid/ipc/network namespaces, build the runs' minimal
  root and ``pivot_root`` into it (``rootfs``), mount each run's tmpfs and ``/proc``, mount
  a private cgroup tree in a container;
- ``SETUID``: drop each run to its own uid (``setresuid``), and read a run's files with its
  file-system uid (``setfsuid``) when fetching them;
- ``SETGID``: the same for the run's gid (``setresgid``, ``setgroups([])``, ``setfsgid``);
- ``CHOWN``: hand the run's working directory and input files to the run's uid;
- ``SETPCAP``: empty the zygotes' capability bounding set (inherited by every run).

Not needed: ``DAC_OVERRIDE``/``DAC_READ_SEARCH`` (the working directory is entered before
it is handed over; fetched files are read as their owner), ``KILL`` (a run is ended by
killing its pid-namespace init, a root process; the kernel kills the rest).
"""

from __future__ import annotations

import os

from services.common.config import ConfigError
from services.sandbox.config import SandboxConfig
from services.sandbox.runner import HEAD

CAPABILITIES = ("SYS_ADMIN", "SETUID", "SETGID", "CHOWN", "SETPCAP")


def check_isolation_available(cfg: SandboxConfig) -> None:
    """Root is needed in every mode: no run executes without its namespaces and minimal root."""
    if not HEAD and cfg.max_sessions:
        raise ConfigError("sessions need coreutils' head (/usr/bin/head or /bin/head): it holds each "
                          "session's pid namespace; install coreutils or set max_sessions=0")
    if os.geteuid() != 0:
        raise ConfigError(
            f"the sandbox needs root inside its container (capabilities {', '.join(CAPABILITIES)}; see "
            "services/sandbox/preflight.py for why each); it runs the model's code as "
            f"uid {cfg.uid_base}+slot, never as root. Current euid is {os.geteuid()}.")
    top = cfg.uid_base + cfg.max_concurrency
    if top > 2**31 - 2:
        raise ConfigError(f"uid_base + max_concurrency = {top} is not a valid uid range")
