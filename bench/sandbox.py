"""Sandbox benchmark: our service vs SandboxFusion's fresh-``python file.py`` method, one run.

Both are real HTTP servers on loopback, started here as separate processes with the same
concurrency limit; the same closed-loop load (``C`` clients, each sending its next request
when the previous answer arrives) runs for ``--seconds`` per cell. Prints throughput and
p50/p99 latency for each workload x concurrency, and our/baseline ratios. Where cgroup v1
``cpuacct`` is writable, each server tree is started in its own group and the CPU time it
spent per request is printed too: on a shared, busy machine that ratio is the steadier one.

Usage: ``python bench/sandbox.py [--quick] [--concurrency 1 32 128] [--seconds 10]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
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
    body = json.dumps({"code": code, "language": "python", "run_timeout": 60}).encode()

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


def _cell(system: str, url: str, workload: str, concurrency: int, seconds: float, meter: CpuMeter) -> Cell:
    code, expect = WORKLOADS[workload]
    cpu_before = meter.seconds()
    start = time.perf_counter()
    lat, failures = asyncio.run(_load(url, code, expect, concurrency, seconds))
    elapsed = time.perf_counter() - start
    cpu_after = meter.seconds()
    lat_ms = sorted(x * 1000 for x in lat)
    p99 = lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))]
    cpu = None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before) * 1000 / len(lat)
    return Cell(system, workload, concurrency, len(lat), failures, len(lat) / elapsed,
                statistics.median(lat_ms), p99, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--seconds", type=float, default=10.0, help="load duration per cell")
    parser.add_argument("--quick", action="store_true", help="3 s per cell, concurrency 1 and 32")
    parser.add_argument("--baseline-python", default="runtime",
                        help="interpreter of the baseline: 'runtime' (the runs' own, default: both sides "
                             "run the same environment), 'service' (this interpreter), or a path")
    parser.add_argument("--out", default="bench/results/sandbox.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.concurrency = 3.0, [1, 32]
    max_c = max(args.concurrency)

    cells: list[Cell] = []
    port = free_port()
    runtime = {"runtime": resolve_runtime_python("auto"), "service": sys.executable}.get(
        args.baseline_python, args.baseline_python)
    meters = {"ours": CpuMeter("ours"), "baseline": CpuMeter("baseline")}
    baseline = subprocess.Popen([*meters["baseline"].wrapper(), sys.executable,
                                 str(Path(__file__).with_name("baseline_sandbox.py")),
                                 "--port", str(port), "--concurrency", str(max_c), "--python", runtime],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http_healthy(f"http://127.0.0.1:{port}/healthz", 60, baseline)
        with SandboxProcess(["--set", f"max_concurrency={max_c}"], wrapper=meters["ours"].wrapper()) as ours:
            asyncio.run(_load(ours.url, "print(1)", "1\n", 4, 1.0))  # warm connections
            for workload in args.workloads:
                for c in args.concurrency:
                    for system, url in (("ours", ours.url), ("baseline", f"http://127.0.0.1:{port}")):
                        cell = _cell(system, url, workload, c, args.seconds, meters[system])
                        cells.append(cell)
                        print(f"{system:9s} {workload:6s} c={c:<4d} {cell.throughput:8.1f} req/s  "
                              f"p50 {cell.p50_ms:8.1f} ms  p99 {cell.p99_ms:8.1f} ms  "
                              f"n={cell.requests} failed={cell.failures}", flush=True)
    finally:
        baseline.terminate()
        baseline.wait(10)
        for meter in meters.values():
            meter.remove()

    print("\n| workload | conc. | ours req/s | baseline req/s | ratio | ours p50/p99 ms "
          "| baseline p50/p99 ms | failures (ours/base) | CPU ms/req (ours/base) | CPU ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    by_key = {(c.system, c.workload, c.concurrency): c for c in cells}
    for workload in args.workloads:
        for c in args.concurrency:
            o, b = by_key[("ours", workload, c)], by_key[("baseline", workload, c)]
            cpu = "n/a | n/a"
            if o.cpu_ms_per_request and b.cpu_ms_per_request:
                cpu = (f"{o.cpu_ms_per_request:.1f}/{b.cpu_ms_per_request:.1f} | "
                       f"{b.cpu_ms_per_request / o.cpu_ms_per_request:.1f}x")
            print(f"| {workload} | {c} | {o.throughput:.1f} | {b.throughput:.1f} | "
                  f"{o.throughput / max(b.throughput, 1e-9):.1f}x | {o.p50_ms:.0f}/{o.p99_ms:.0f} | "
                  f"{b.p50_ms:.0f}/{b.p99_ms:.0f} | {o.failures}/{b.failures} | {cpu} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps([asdict(c) for c in cells], indent=1))
    print(f"\nraw results: {args.out}  (cpus: {os.cpu_count()}, baseline python: {runtime})")


if __name__ == "__main__":
    main()
