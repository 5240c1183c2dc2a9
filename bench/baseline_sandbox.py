"""Baseline executors for the sandbox benchmark, same HTTP API as ours.

- ``python``: SandboxFusion's method. Every request writes the code to a fresh temp dir and
  runs ``python file.py`` there in a new process (no warm interpreter), at most
  ``--concurrency`` at once. No isolation is added, which only flatters the baseline.
- ``--bwrap``: the same, inside ``bwrap`` per run with an allowlist equivalent to ours
  (``bwrap_argv``): the system directories and the runtime read-only, a fresh ``/proc``,
  bwrap's minimal ``/dev``, a tmpfs ``/tmp`` with the code's directory at ``/tmp/workspace``,
  every namespace unshared (user, pid, net, ipc, uts, cgroup), uid 61000, and our own
  seccomp program (``--seccomp``). What it does not do: cgroups.

Usage: ``python bench/baseline_sandbox.py --port P [--concurrency 128] [--python PATH] [--bwrap]``
(``--python``: the interpreter that runs the code; the bench passes the sandbox's runtime)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from services.sandbox import syscall_filter
from services.sandbox.rootfs import HIDDEN_DIRS, SYSTEM_DIRS, TOP_LINKS, outermost
from services.transport.sandbox.schemas import CommandRunResult, RunCodeRequest, RunCodeResponse

REPO = Path(__file__).resolve().parents[1]
WORKDIR = "/tmp/workspace"


def bwrap_argv(python: str) -> list[str]:
    """bwrap's flags for one run (then ``--seccomp FD --bind DIR /tmp/workspace ... python main.py``)."""
    probe = "import json, sys; print(json.dumps([sys.base_prefix, sys.prefix, *sys.path]))"
    paths = json.loads(subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True,
                                      cwd="/").stdout)
    runtime = {os.path.realpath(p) for p in paths if p and os.path.isdir(p)} - {"/"}
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--uid", "61000", "--gid", "61000",
            "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    for path in TOP_LINKS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
    dirs = [p for p in (*SYSTEM_DIRS, *(t for t in TOP_LINKS if not os.path.islink(t))) if os.path.isdir(p)]
    for path in outermost(dirs):
        argv += ["--ro-bind", path, path]
    for cover in HIDDEN_DIRS:  # as ours: /usr/local covered (the runtime bound over it if there)
        if os.path.isdir(cover):
            argv += ["--tmpfs", cover, "--remount-ro", cover]
    for path in outermost(sorted(runtime)):
        if not any(path == d or path.startswith(d + "/") for d in dirs) or any(
                path == h or path.startswith(h + "/") for h in HIDDEN_DIRS):
            argv += ["--ro-bind", path, path]
    bin_dir = os.path.dirname(python)
    return [*argv, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--clearenv",
            "--setenv", "PATH", f"{bin_dir}:/usr/bin:/bin", "--setenv", "HOME", WORKDIR,
            "--setenv", "LANG", "C.UTF-8"]


def export_filter(python: str, path: str) -> None:
    """Our runs' seccomp program (libseccomp in the runtime), written once for every bwrap run."""
    Path(path).write_bytes(syscall_filter.export(python, str(REPO)))


def create_app(concurrency: int, python: str = sys.executable, bwrap: bool = False) -> FastAPI:
    app = FastAPI()
    sem = asyncio.Semaphore(concurrency)
    state = tempfile.mkdtemp(prefix="retool-bwrap-bench-")
    seccomp_file = os.path.join(state, "filter.bpf")
    prefix: list[str] = []
    if bwrap:
        export_filter(python, seccomp_file)
        prefix = bwrap_argv(python)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/run_code")
    async def run_code(req: RunCodeRequest) -> RunCodeResponse:
        async with sem:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "main.py")
                with open(path, "w") as fh:
                    fh.write(req.code)
                start = time.perf_counter()
                if prefix:
                    os.chmod(tmp, 0o755)
                    seccomp = os.open(seccomp_file, os.O_RDONLY)  # bwrap reads it, at the same number
                    argv = [*prefix, "--seccomp", str(seccomp), "--bind", tmp, WORKDIR, "--chdir", WORKDIR,
                            python, "main.py"]
                    kwargs = {"pass_fds": (seccomp,)}
                else:
                    seccomp = -1
                    argv, kwargs = [python, path], {}
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *argv, cwd=tmp, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE, **kwargs)
                finally:
                    if seccomp >= 0:
                        os.close(seccomp)
                try:
                    out, err = await asyncio.wait_for(
                        proc.communicate((req.stdin or "").encode()), req.run_timeout or 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                    return RunCodeResponse(status="Failed", run_result=CommandRunResult(
                        status="TimeLimitExceeded", execution_time=time.perf_counter() - start))
                result = CommandRunResult(status="Finished", execution_time=time.perf_counter() - start,
                                          return_code=proc.returncode, stdout=out.decode(),
                                          stderr=err.decode())
                return RunCodeResponse(status="Success" if proc.returncode == 0 else "Failed",
                                       run_result=result)

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--bwrap", action="store_true", help="each run inside bwrap (allowlist, seccomp)")
    a = parser.parse_args()
    # asyncio loop: uvloop mishandles communicate() on processes that exit before reading stdin
    uvicorn.run(create_app(a.concurrency, a.python, a.bwrap), host=a.host, port=a.port, log_level="warning",
                backlog=4096, loop="asyncio")
