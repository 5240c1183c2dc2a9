"""``retool demo``: the README's main job on an embedded default.

Until the full ReTool pipeline lands, the demo starts the sandbox service as a separate
process on a free loopback port and runs a few sample tool calls through its HTTP API.
"""

from __future__ import annotations

import json
import sys

SAMPLES = [
    ("hello", 'print("Hello, world!")'),
    ("sympy", "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 2, x))"),
    ("numpy", "import numpy as np\nprint(np.linalg.inv(np.eye(3) * 2).trace())"),
    ("error", "1/0"),
    ("timeout", "while True: pass"),
]


def run() -> None:
    import httpx

    from services.sandbox.launcher import SandboxProcess

    with SandboxProcess() as sandbox:
        print(f"sandbox up at {sandbox.url}", file=sys.stderr)
        with httpx.Client(base_url=sandbox.url, timeout=60) as client:
            for name, code in SAMPLES:
                body = {"code": code, "language": "python",
                        "run_timeout": 2 if name == "timeout" else 10}
                resp = client.post("/run_code", json=body).json()
                run_result = resp.get("run_result") or {}
                print(json.dumps({"sample": name, "status": resp["status"],
                                  "run_status": run_result.get("status"),
                                  "stdout": run_result.get("stdout"),
                                  "stderr_tail": (run_result.get("stderr") or "")[-120:],
                                  "execution_time": run_result.get("execution_time")}))
