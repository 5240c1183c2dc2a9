"""Pure parts of the sandbox's isolation: the tree's allowlist, phase accounting, CPU limits,
the fail-closed configuration. The layers themselves are tested against a real service
(``tests/integration/test_sandbox_escape.py``)."""

from __future__ import annotations

import os
import struct
import sys

import pytest

from services.common.config import ConfigError, load_config
from services.sandbox import rootfs
from services.sandbox.cgroups import CPU_PERIOD_US, cpu_quota_us
from services.sandbox.config import SandboxConfig
from services.sandbox.limits import clamp_cpu, resolve_limits
from services.sandbox.phases import PHASES, PhaseBoard
from services.transport.sandbox.schemas import RunCodeRequest


def test_outermost_keeps_only_the_top_of_each_subtree():
    paths = ["/usr", "/usr/lib", "/root/.pyenv/versions/3.11.7", "/root/.pyenv/versions/3.11.7/lib",
             "/work/a/.venv-runtime", "/work/a/.venv-runtime-2"]
    assert rootfs.outermost(paths) == ["/root/.pyenv/versions/3.11.7", "/usr", "/work/a/.venv-runtime",
                                       "/work/a/.venv-runtime-2"]


def test_runtime_paths_never_include_the_root_or_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    paths = rootfs.runtime_paths(exclude=[])
    assert str(tmp_path) not in paths and "/" not in paths
    assert any(os.path.realpath(sys.base_prefix).startswith(p) for p in paths)  # the interpreter is in
    monkeypatch.setattr(sys, "path", ["/", *sys.path])
    monkeypatch.chdir("/tmp")
    with pytest.raises(ValueError, match="whole host"):
        rootfs.runtime_paths(exclude=[])


def test_the_trees_etc_has_the_run_accounts_and_nothing_of_the_host():
    files = rootfs.etc_files(range(61000, 61003))
    users = [line.split(":") for line in files["/etc/passwd"].splitlines()]
    assert [u[0] for u in users] == ["root", "nobody", "run0", "run1", "run2"]
    assert [int(u[2]) for u in users[2:]] == [61000, 61001, 61002]
    assert all(u[6] in ("/usr/sbin/nologin", "/bin/sh") for u in users)
    assert set(files) == {"/etc/passwd", "/etc/group", "/etc/hosts", "/etc/hostname", "/etc/nsswitch.conf"}


def test_phase_split_attributes_cpu_to_each_step():
    board = PhaseBoard(4)
    board.clear(2)
    for index in range(6):  # what a run process records, at 1, 2, ... 6 ms of its CPU
        struct.pack_into("q", board._mem, board.row(2) + 8 * index, (index + 1) * 1_000_000)
    split = board.split(2, fork_s=0.0005, init_s=0.0001, total_s=0.010)
    assert set(split) == set(PHASES)
    assert split["fork"] == 0.0005 and split["init"] == 0.0001 and split["run_start"] == 0.001
    assert all(abs(split[k] - 0.001) < 1e-9 for k in ("namespaces", "cgroup", "mounts", "filter", "code"))
    assert abs(split["exit"] - 0.004) < 1e-9  # wait4's total after the last mark
    board.clear(3)  # a run that failed before its first mark: only what the zygote saw, and exit
    early = board.split(3, fork_s=0.0004, init_s=0.0, total_s=0.002)
    assert early == {"fork": 0.0004, "init": 0.0, "run_start": 0.0, "exit": 0.002}


def test_cpu_limits_default_to_one_core_and_requests_may_only_ask_less():
    cfg = SandboxConfig()
    assert cpu_quota_us(1.0) == CPU_PERIOD_US and cpu_quota_us(0.25) == CPU_PERIOD_US // 4
    assert cpu_quota_us(0.0001) == 1000  # the kernel's minimum quota
    notes: list[str] = []
    assert clamp_cpu(None, cfg, notes) == 1.0 and clamp_cpu(0.5, cfg, notes) == 0.5 and notes == []
    assert clamp_cpu(4, cfg, notes) == 1.0 and notes == ["cpu_cores 4 clamped to the maximum 1"]
    limits = resolve_limits(RunCodeRequest(code="1", cpu_cores=0.5), cfg)
    assert limits.cpu_cores == 0.5
    with pytest.raises(ValueError, match="cpu_cores"):
        RunCodeRequest(code="1", cpu_cores=0)


def test_running_without_cgroups_needs_isolation_degraded():
    with pytest.raises(ConfigError, match="isolation: degraded"):
        load_config(SandboxConfig, overrides=["use_cgroups=false"])
    cfg = load_config(SandboxConfig, overrides=["use_cgroups=false", "isolation=degraded"])
    assert cfg.isolation == "degraded"
    with pytest.raises(ConfigError, match="isolation"):
        load_config(SandboxConfig, overrides=["isolation=off"])
