"""Concurrency, admission control and self-healing of the sandbox service."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from services.sandbox.launcher import SandboxProcess
from tests.integration.sandbox_client import run_code, stdout_of

pytestmark = pytest.mark.integration


async def test_250_simultaneous_requests_all_answered_correctly(sandbox_url):
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    async with httpx.AsyncClient(base_url=sandbox_url, timeout=180, limits=limits) as client:
        async def one(i: int) -> tuple[int, dict]:
            code = f"import sys\nn = int(sys.stdin.read())\nprint(n * n + {i})"
            r = await client.post("/run_code", json={"code": code, "language": "python", "stdin": str(i)})
            return r.status_code, r.json()

        results = await asyncio.gather(*(one(i) for i in range(250)))
    for i, (status, body) in enumerate(results):
        assert status == 200 and body["status"] == "Success", body
        assert body["run_result"]["stdout"] == f"{i * i + i}\n"


async def test_full_queue_answers_504_fast_and_never_hangs(tmp_path):
    """Beyond ``max_queue`` waiting requests the answer is an immediate 504 (verl retries it);
    the waiting ones are served once slots free up."""
    args = ["--set", "max_concurrency=2", "--set", "max_queue=2", "--set", "zygotes=1",
            "--set", "light_zygotes=0", "--set", "heavy_zygotes=0"]
    with SandboxProcess(args, log_path=str(tmp_path / "sb.log")) as sb:
        async with httpx.AsyncClient(base_url=sb.url, timeout=60) as client:
            slow = {"code": "import time; time.sleep(3)", "language": "python", "compile_timeout": 30}
            busy = [asyncio.create_task(client.post("/run_code", json=slow)) for _ in range(4)]
            deadline = time.monotonic() + 60
            while True:  # 2 running, 2 queued
                h = (await client.get("/healthz")).json()
                if (h["in_flight"], h["queued"]) == (2, 2):
                    break
                assert time.monotonic() < deadline, h
                await asyncio.sleep(0.05)
            start = time.monotonic()
            r = await client.post("/run_code", json={"code": "print(1)", "language": "python"})
            assert r.status_code == 504 and "max_queue=2" in r.json()["detail"]
            assert time.monotonic() - start < 10  # at once, not after a queue wait (15 s here)
            assert r.headers["retry-after"] == "1"
            done = await asyncio.gather(*busy)
            assert all(d.status_code == 200 and d.json()["status"] == "Success" for d in done)
            metrics = (await client.get("/metrics")).text
            assert 'sandbox_rejections_total{reason="queue_full"} 1.0' in metrics


def test_dead_zygote_is_replaced_and_service_recovers(tmp_path):
    args = ["--set", "zygotes=1", "--set", "light_zygotes=0", "--set", "heavy_zygotes=0"]
    with SandboxProcess(args, log_path=str(tmp_path / "sb.log")) as sb:
        with open(f"/proc/{sb.proc.pid}/task/{sb.proc.pid}/children") as fh:
            children = fh.read().split()
        zygote_pid = int(children[0])
        os.kill(zygote_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = run_code(sb.url, "print('back')")
            if r["status"] == "Success":
                break
            assert r["status"] == "SandboxError"  # never a crash or a hang meanwhile
            time.sleep(0.5)
        assert stdout_of(r) == "back\n"
