"""A Docker engine and ``docker compose`` for the deployment smoke test.

Invariant: :func:`require_engine` either returns (an engine answers, compose v2 is there) or
skips with the reason, except when ``RETOOL_DOCKER_TESTS=require`` (CI sets it): then a
missing engine fails the test instead, so CI cannot go green without running it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "RETOOL_DOCKER_TESTS"


def _missing(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "require":
        pytest.fail(f"{REQUIRE_ENV}=require but {reason}", pytrace=False)
    pytest.skip(f"{reason} (start one, e.g. ../shared/docker/up.sh on machines without a registry; "
                f"{REQUIRE_ENV}=require makes this a failure)")


def require_engine() -> None:
    if shutil.which("docker") is None:
        _missing("no docker CLI on PATH")
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                          text=True, timeout=60)
    if info.returncode != 0:
        _missing(f"no Docker engine answers (DOCKER_HOST={os.environ.get('DOCKER_HOST', 'default')}): "
                 f"{info.stderr.strip()[-300:]}")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60).returncode != 0:
        _missing("the Docker engine answers but `docker compose` (v2) is not installed")


def run(args: Sequence[str], *, timeout: float, check: bool = True, input: str | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, input=input, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} -> {proc.returncode}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # type: ignore[no-any-return]


def write_compose_env(path: Path, *, image: str, model: Path, data: Path, sandbox_concurrency: int,
                      extra: Sequence[str] = ()) -> int:
    """The compose env file of a test stack (fresh tokens, free host ports for Prometheus and
    Grafana, then ``extra`` lines); returns Prometheus' host port."""
    prometheus_port = free_port()
    path.write_text("\n".join([
        f"RETOOL_IMAGE={image}", f"MODEL_DIR={model}", f"DATA_DIR={data}", *extra,
        f"RETOOL_WEIGHT_TOKEN={secrets.token_hex(16)}", f"GRAFANA_ADMIN_PASSWORD={secrets.token_hex(8)}",
        f"PROMETHEUS_PORT={prometheus_port}", f"GRAFANA_PORT={free_port()}",
        f"SANDBOX_MAX_CONCURRENCY={sandbox_concurrency}",
    ]) + "\n")
    return prometheus_port


def build_image(tag: str) -> None:
    """``docker build`` of the CPU image as a user builds it (classic builder: no BuildKit on every
    engine); layers are cached, so a second test of the session costs seconds."""
    run(["env", "DOCKER_BUILDKIT=0", "docker", "build", "--network", "host", "-f", "deploy/docker/Dockerfile",
         "-t", tag, "."], timeout=1800)


def image_exists(tag: str) -> bool:
    return run(["docker", "image", "inspect", tag], timeout=60, check=False).returncode == 0


@dataclass
class Phases:
    """Wall time of each phase, printed as it ends (to the real terminal, past pytest's capture)."""

    times: dict[str, float] = field(default_factory=dict)
    _start: float = field(default_factory=time.monotonic)

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.times[name] = round(now - self._start, 1)
        self._start = now
        sys.__stderr__.write(f"\n[compose smoke] {name}: {self.times[name]} s\n")
        sys.__stderr__.flush()


@dataclass
class Compose:
    """``docker compose`` on the project's file plus the test's override, as one project."""

    project: str
    env_file: Path
    files: list[Path]
    profile: str = "cpu"

    def cmd(self, *args: str, timeout: float = 600, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        base = ["docker", "compose", "-p", self.project, "--env-file", str(self.env_file),
                "--profile", self.profile]
        for f in self.files:
            base += ["-f", str(f)]
        return run([*base, *args], timeout=timeout, check=check, input=input)

    def containers(self) -> list[dict]:
        out = self.cmd("ps", "-a", "--format", "json", timeout=60).stdout.strip()
        if not out:
            return []
        if out.startswith("["):
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def python(self, service: str, code: str, *, index: int = 1, timeout: float = 120,
               check: bool = True, user: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``python -`` (code on stdin) in a service's container."""
        args = ["exec", "-T", "--index", str(index)]
        if user:
            args += ["--user", user]
        return self.cmd(*args, service, "python", "-", timeout=timeout, check=check, input=code)

    def json_from(self, service: str, code: str, **kw) -> object:
        out = self.python(service, code, **kw).stdout.strip().splitlines()
        assert out, f"no output from {service}"
        return json.loads(out[-1])

    def logs(self, service: str, tail: int = 200) -> str:
        p = self.cmd("logs", "--no-color", "--tail", str(tail), service, timeout=60, check=False)
        return p.stdout + p.stderr


def wait_for(what: str, probe, timeout_s: float, interval_s: float = 2.0, diag=None):
    """Call ``probe()`` until it returns something truthy; fail with the last value at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (AssertionError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval_s)
    extra = diag() if diag else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last: {last!r}\n{extra}")
