"""Sandbox benchmark: our service vs ``python file.py`` (SandboxFusion's method) vs ``bwrap`` per run.

All three are real HTTP servers on loopback, started here as separate processes with the same
concurrency limit (``baseline_sandbox.py`` serves both baselines; its ``--bwrap`` mode wraps
each run in bubblewrap with an allowlist and seccomp program equivalent to ours). The same
closed-loop load (``C`` clients, each sending its next request when the previous answer
arrives) runs for ``--seconds`` per cell. Prints throughput and p50/p99 latency for each
workload x concurrency, the ratios ours/baseline, and, for ours, where a run's CPU time goes
(the service's HTTP handling, the zygote's loop, and the run's own steps from
``/metrics``: fork, init, namespaces, cgroup attach, mounts, filter, user code, exit).
Where cgroup v1 ``cpuacct`` is writable, each server tree is started in its own group and
the CPU time it spent per request is printed too: on a shared, busy machine that ratio is
the steadier one.

Usage: ``python bench/sandbox.py [--quick] [--concurrency 32] [--seconds 10] [--systems ours python bwrap]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.process import free_port, wait_http_healthy  # noqa: E402
from services.sandbox.launcher import SandboxProcess  # noqa: E402
from services.sandbox.runtime_env import resolve_runtime_python  # noqa: E402

WORKLOADS = {
    "hello": ('print("Hello, world!")', "Hello, world!\n"),
    "sympy": ("import sympy as sp; x = sp.symbols('x'); print(sp.solve(x**2 - 2, x))",
              "[-sqrt(2), sqrt(2)]\n"),
    "numpy": ("import numpy as np; a = np.arange(1, 101); "
              "print(int(a @ a), float(np.linalg.inv(np.eye(100) * 2).trace()))", "338350 50.0\n"),
}


class CpuMeter:
    """CPU time of a process tree started inside its own cgroup v1 ``cpuacct`` group."""

    ROOT = "/sys/fs/cgroup/cpuacct"

    def __init__(self, name: str) -> None:
        self.path = os.path.join(self.ROOT, f"retool-bench-{name}-{os.getpid()}")
        try:
            os.makedirs(self.path)
            self.ok = True
        except OSError:
            self.ok = False

    def wrapper(self) -> list[str]:
        """Command prefix that moves the process into the group, then execs the command."""
        if not self.ok:
            return []
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"]

    def seconds(self) -> float | None:
        if not self.ok:
            return None
        with open(os.path.join(self.path, "cpuacct.usage")) as fh:
            return int(fh.read()) / 1e9

    def remove(self) -> None:
        if self.ok:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)


@dataclass
class Cell:
    system: str
    workload: str
    concurrency: int
    requests: int
    failures: int
    throughput: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_request: float | None = None
    split_ms: dict[str, float] = field(default_factory=dict)  # ours: CPU ms per run, by step


class _Conn:
    """Minimal keep-alive HTTP/1.1 POST client: the load generator shares the 2 cores with the
    servers, so it must cost far less per request than they do (httpx costs ~1.5 ms)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _load(url: str, code: str, expect: str, concurrency: int,
                seconds: float) -> tuple[list[float], int]:
    latencies: list[float] = []
    failures = 0
    deadline = time.monotonic() + seconds
    host, port = url.removeprefix("http://").split(":")
    # generous: on a loaded 2-core machine 32 cold sympy imports at once take minutes
    body = json.dumps({"code": code, "language": "python", "run_timeout": 300}).encode()

    async def worker() -> None:
        nonlocal failures
        conn = _Conn(host, int(port))
        try:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                try:
                    status, payload = await conn.post_json("/run_code", body)
                    ok = status == 200 and json.loads(payload)["run_result"]["stdout"] == expect
                except (OSError, asyncio.IncompleteReadError, ValueError, KeyError, TypeError):
                    ok = False
                    conn.close()
                    conn = _Conn(host, int(port))
                latencies.append(time.perf_counter() - start)
                failures += not ok
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, failures


class Split:
    """CPU per run of our service, by step: the service and zygote processes (``/proc``) and the
    run's own steps (``sandbox_run_phase_cpu_seconds_total`` in ``/metrics``)."""

    def __init__(self, url: str, service_pid: int) -> None:
        self.url, self.service_pid = url, service_pid

    def _zygotes(self) -> list[int]:
        out = []
        for tid in os.listdir(f"/proc/{self.service_pid}/task"):
            with open(f"/proc/{self.service_pid}/task/{tid}/children") as fh:
                for pid in fh.read().split():
                    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmd:
                        if b"services.sandbox.zygote" in cmd.read():
                            out.append(int(pid))
        return out

    @staticmethod
    def _cpu(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _phases(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("sandbox_run_phase_cpu_seconds_total{"):
                out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
            elif line.startswith("sandbox_run_phase_runs_total "):
                out["_runs"] = float(line.rsplit(" ", 1)[1])
        return out

    def snapshot(self) -> dict[str, float]:
        snap = self._phases()
        snap["_service"] = self._cpu(self.service_pid)
        snap["_zygotes"] = sum(self._cpu(p) for p in self._zygotes())
        return snap

    @staticmethod
    def per_run(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
        runs = max(after["_runs"] - before["_runs"], 1)
        d = {k: (after[k] - before.get(k, 0.0)) for k in after}
        steps = {k: d[k] / runs * 1000 for k in d if not k.startswith("_")}
        zygote_side = steps.get("fork", 0.0) + steps.get("init", 0.0)
        return {"service": d["_service"] / max(requests, 1) * 1000,
                "zygote loop": max(d["_zygotes"] / runs * 1000 - zygote_side, 0.0), **steps}


def _cell(system: str, url: str, workload: str, concurrency: int, seconds: float, meter: CpuMeter,
          split: Split | None) -> Cell:
    code, expect = WORKLOADS[workload]
    cpu_before = meter.seconds()
    split_before = split.snapshot() if split else None
    start = time.perf_counter()
    lat, failures = asyncio.run(_load(url, code, expect, concurrency, seconds))
    elapsed = time.perf_counter() - start
    cpu_after = meter.seconds()
    lat_ms = sorted(x * 1000 for x in lat)
    p99 = lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))]
    cpu = None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before) * 1000 / len(lat)
    steps = Split.per_run(split_before, split.snapshot(), len(lat)) if split and split_before else {}
    return Cell(system, workload, concurrency, len(lat), failures, len(lat) / elapsed,
                statistics.median(lat_ms), p99, cpu, steps)


def _baseline(name: str, port: int, max_c: int, runtime: str, meter: CpuMeter) -> subprocess.Popen:
    extra = ["--bwrap"] if name == "bwrap" else []
    script = str(Path(__file__).with_name("baseline_sandbox.py"))
    return subprocess.Popen([*meter.wrapper(), sys.executable, script, "--port", str(port), "--concurrency",
                             str(max_c), "--python", runtime, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _print_tables(cells: list[Cell], workloads: list[str], concurrency: list[int],
                  systems: list[str]) -> None:
    by_key = {(c.system, c.workload, c.concurrency): c for c in cells}
    print("\n| workload | conc. | system | req/s | p50/p99 ms | failures | CPU ms/req "
          "| ours vs it: req/s | CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for workload in workloads:
        for c in concurrency:
            o = by_key.get(("ours", workload, c))
            for system in systems:
                x = by_key[(system, workload, c)]
                cpu = f"{x.cpu_ms_per_request:.1f}" if x.cpu_ms_per_request else "n/a"
                ratio = cpu_ratio = "-"
                if o is not None and system != "ours":
                    ratio = f"{o.throughput / max(x.throughput, 1e-9):.1f}x"
                    if o.cpu_ms_per_request and x.cpu_ms_per_request:
                        cpu_ratio = f"{x.cpu_ms_per_request / o.cpu_ms_per_request:.1f}x"
                print(f"| {workload} | {c} | {system} | {x.throughput:.1f} | {x.p50_ms:.0f}/{x.p99_ms:.0f} | "
                      f"{x.failures} | {cpu} | {ratio} | {cpu_ratio} |")
    ours = [c for c in cells if c.system == "ours" and c.split_ms]
    if not ours:
        return
    order = ["service", "zygote loop", "fork", "init", "run_start", "namespaces", "cgroup", "mounts",
             "filter", "code", "exit"]
    print("\nOurs, CPU ms per run by step (service: HTTP + dispatch; zygote loop: IPC, output, reaping; "
          "fork: the zygote's side, run_start: the child's; exit: address space + namespaces torn down)")
    print("| workload | conc. | " + " | ".join(order) + " | sum |")
    print("|---|---|" + "---|" * (len(order) + 1))
    for c in ours:
        vals = [c.split_ms.get(k, 0.0) for k in order]
        print(f"| {c.workload} | {c.concurrency} | " + " | ".join(f"{v:.2f}" for v in vals)
              + f" | {sum(vals):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32])
    parser.add_argument("--workloads", nargs="+", default=["hello", "sympy"], choices=list(WORKLOADS))
    parser.add_argument("--systems", nargs="+", default=["ours", "python", "bwrap"],
                        choices=["ours", "python", "bwrap"])
    parser.add_argument("--seconds", type=float, default=10.0, help="load duration per cell")
    parser.add_argument("--quick", action="store_true", help="4 s per cell")
    parser.add_argument("--baseline-python", default="runtime",
                        help="interpreter of the baselines: 'runtime' (the runs' own, default: every side "
                             "runs the same environment), 'service' (this interpreter), or a path")
    parser.add_argument("--out", default="bench/results/sandbox.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 4.0
    if "bwrap" in args.systems and not shutil.which("bwrap"):
        parser.error("bwrap is not installed (Debian: apt-get install bubblewrap); or leave it out of "
                     "--systems")
    max_c = max(args.concurrency)
    runtime = {"runtime": resolve_runtime_python("auto"), "service": sys.executable}.get(
        args.baseline_python, args.baseline_python)
    meters = {name: CpuMeter(name) for name in args.systems}
    ports = {name: free_port() for name in args.systems if name != "ours"}
    baselines = {name: _baseline(name, port, max_c, runtime, meters[name]) for name, port in ports.items()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    cells: list[Cell] = []
    try:
        for name, proc in baselines.items():
            wait_http_healthy(f"{urls[name]}/healthz", 120, proc)
        ours_args = ["--set", f"max_concurrency={max_c}"]
        with SandboxProcess(ours_args, wrapper=meters["ours"].wrapper() if "ours" in meters else ()) as ours:
            urls["ours"] = ours.url
            split = Split(ours.url, ours.proc.pid)
            for url in urls.values():
                asyncio.run(_load(url, "print(1)", "1\n", 4, 1.0))  # warm connections
            for workload in args.workloads:
                for c in args.concurrency:
                    for system in args.systems:
                        cell = _cell(system, urls[system], workload, c, args.seconds, meters[system],
                                     split if system == "ours" else None)
                        cells.append(cell)
                        print(f"{system:7s} {workload:6s} c={c:<4d} {cell.throughput:8.1f} req/s  "
                              f"p50 {cell.p50_ms:8.1f} ms  p99 {cell.p99_ms:8.1f} ms  "
                              f"n={cell.requests} failed={cell.failures}", flush=True)
    finally:
        for proc in baselines.values():
            proc.terminate()
            proc.wait(10)
        for meter in meters.values():
            meter.remove()
    _print_tables(cells, args.workloads, args.concurrency, args.systems)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps([asdict(c) for c in cells], indent=1))
    print(f"\nraw results: {args.out}  (cpus: {os.cpu_count()}, baseline python: {runtime})")


if __name__ == "__main__":
    main()
