"""Baseline executor for the sandbox benchmark: SandboxFusion's method, same HTTP API.

Every request writes the code to a fresh temp dir and runs ``python file.py`` there in a
new process (no warm interpreter), at most ``--concurrency`` at once. No isolation is
added, which only flatters the baseline.

Usage: ``python bench/baseline_sandbox.py --port P [--concurrency 128] [--python PATH]``
(``--python``: the interpreter that runs the code; the bench passes the sandbox's runtime)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import uvicorn
from fastapi import FastAPI

from services.sandbox.schemas import CommandRunResult, RunCodeRequest, RunCodeResponse


def create_app(concurrency: int, python: str = sys.executable) -> FastAPI:
    app = FastAPI()
    sem = asyncio.Semaphore(concurrency)

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
                proc = await asyncio.create_subprocess_exec(
                    python, path, cwd=tmp, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
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
    a = parser.parse_args()
    # asyncio loop: uvloop mishandles communicate() on processes that exit before reading stdin
    uvicorn.run(create_app(a.concurrency, a.python), host=a.host, port=a.port, log_level="warning",
                backlog=4096, loop="asyncio")
