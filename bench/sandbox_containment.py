"""The escape-probe suite against our service and against ``bwrap`` per run, side by side.

Both are real HTTP servers on loopback (ours: ``retool sandbox serve``; bwrap: the bench's
``baseline_sandbox.py --bwrap``, the same allowlist and seccomp program as ours). Each probe
of ``tests/helpers/escape_probes.py`` runs once on each; the table says, per probe, what was
breached (empty: contained). Canary files and sockets are created on the host for the
filesystem probe and removed afterwards. The neighbour and CPU probes need a second run
in flight and the service's cgroups: they live in the test suite only.

Usage: ``python bench/sandbox_containment.py``
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.process import free_port, wait_http_healthy  # noqa: E402
from services.sandbox.launcher import SandboxProcess  # noqa: E402
from services.sandbox.runtime_env import resolve_runtime_python  # noqa: E402
from tests.helpers import escape_probes as probes  # noqa: E402
from tests.integration.sandbox_client import run_code, stdout_of  # noqa: E402
from tests.integration.test_sandbox_escape import Canaries  # noqa: E402


def _probe(url: str, code: str, verdict) -> str:  # noqa: ANN001
    r = run_code(url, code, run_timeout=30)
    try:
        breaches = verdict(probes.parse(stdout_of(r)))
    except AssertionError:
        return f"no report ({r['status']}: {(r.get('run_result') or {}).get('status')})"
    return "contained" if not breaches else "; ".join(breaches)[:300]


def main() -> None:
    port = free_port()
    bwrap = subprocess.Popen([sys.executable, str(Path(__file__).with_name("baseline_sandbox.py")), "--port",
                              str(port), "--concurrency", "4", "--python", resolve_runtime_python("auto"),
                              "--bwrap"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows: dict[str, dict[str, str]] = {}
    try:
        wait_http_healthy(f"http://127.0.0.1:{port}/healthz", 120, bwrap)
        with SandboxProcess(["--set", "max_concurrency=4"]) as ours, Canaries() as c:
            cases = {
                "host files and sockets": (probes.files_probe(c.tag, c.files, c.sockets),
                                           lambda s: probes.verdict_files(s, c.tag)),
                "namespaces, mounts, filtered calls": (probes.kernel_probe(), probes.verdict_kernel),
                "/proc, /sys, devices": (probes.proc_probe(), probes.verdict_proc),
            }
            for name, (code, verdict) in cases.items():
                rows[name] = {"ours": _probe(ours.url, code, verdict),
                              "bwrap": _probe(f"http://127.0.0.1:{port}", code, verdict)}
            connected = sorted(set(c.connections))
    finally:
        bwrap.terminate()
        bwrap.wait(10)
    print("| probe | ours | bwrap (same allowlist and seccomp program) |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['ours']} | {row['bwrap']} |")
    print(f"\nhost sockets that accepted a connection: {connected or 'none'}")


if __name__ == "__main__":
    main()
