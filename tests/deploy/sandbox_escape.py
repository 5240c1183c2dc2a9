"""The escape probes (``tests/helpers/escape_probes.py``) inside the compose deployment.

Two scripts, each run by ``docker compose exec`` with the container's own Python:

- ``in_sandbox_container``: in the sandbox's container, where the canaries live. It makes
  canary files (its /tmp and /dev/shm: everything else of the container is read-only) and
  listens on a unix socket outside /tmp and on an abstract one, starts a victim run, then
  sends the files, neighbour, kernel and /proc probes to the service on loopback, stateless
  and through a session, and prints every report plus the connections its sockets accepted;
- ``cpu_hogs``: in a rollout replica (the route the rollout service uses): ``busy`` runs spin
  four threads each while /healthz is timed and a hello run must still complete.

Invariant: the scripts only observe and report (one JSON line); the verdicts are the same
functions the host tests use, applied here.
"""

from __future__ import annotations

import json
from typing import Any

from tests.helpers import escape_probes as probes

_IN_SANDBOX = r"""
import json, os, socket, threading, time, urllib.request
SPEC = json.loads(__SPEC__)
URL = "http://127.0.0.1:8080"
def post(path, body, timeout=120):
    req = urllib.request.Request(URL + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())
def stdout_of(r):
    return (r.get("run_result") or {}).get("stdout") or ""
for f in SPEC["files"]:
    os.makedirs(os.path.dirname(f), 0o755, exist_ok=True)
    with open(f, "w") as fh:
        fh.write('{"answer": "%s"}' % SPEC["tag"])
    os.chmod(f, 0o644)
accepted = []
def serve(s, path):
    while True:
        conn, _ = s.accept()
        accepted.append(path)
        conn.close()
for path in SPEC["sockets"]:
    s = socket.socket(socket.AF_UNIX)
    s.bind("\0" + path[1:] if path.startswith("@") else path)
    if not path.startswith("@"):
        os.chmod(path, 0o777)
    s.listen(8)
    threading.Thread(target=serve, args=(s, path), daemon=True).start()
out = {"health": json.loads(urllib.request.urlopen(URL + "/healthz", timeout=30).read())}
def run(code, session):
    if not session:
        return post("/run_code", {"code": code, "run_timeout": 30})
    sid = post("/sessions", {})["session_id"]
    try:
        return post("/run_code", {"code": code, "session_id": sid, "run_timeout": 30})
    finally:
        urllib.request.urlopen(urllib.request.Request(f"{URL}/sessions/{sid}", method="DELETE"), timeout=60)
def run_pids():
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                uid = int([l for l in open(f"/proc/{p}/status") if l.startswith("Uid:")][0].split()[1])
            except OSError:
                continue
            if uid >= 61000:
                found.append(int(p))
    return found
for mode in ("stateless", "session"):
    victim = {}
    holder = threading.Thread(target=lambda: victim.update(post("/run_code", {"code": SPEC["victim"],
                                                                             "run_timeout": 60})))
    holder.start()
    deadline = time.monotonic() + 60
    while not (pids := run_pids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    reports = {}
    for name, code in SPEC["probes"].items():
        reports[name] = stdout_of(run(code.replace("__PIDS__", repr(pids)), mode == "session"))
    holder.join(120)
    reports["victim"] = stdout_of(victim)
    out[mode] = reports
out["accepted"] = accepted
print(json.dumps(out))
"""


def in_sandbox_container(tag: str) -> str:
    """The script for the sandbox's container; ``tag`` names its canaries."""
    files = [f"/tmp/{tag}/answers.jsonl", f"/dev/shm/{tag}"]
    sockets = [f"/dev/shm/{tag}.sock", f"@{tag}"]
    targets = [*files, "/opt/app/services/sandbox/executor.py", "/opt/venv/bin/python",
               "/home/retool/.bashrc", "/opt/app/bin/retool", "/proc/1/environ"]
    spec = {"tag": tag, "files": files, "sockets": sockets, "victim": probes.victim(tag, 6),
            "probes": {"files": probes.files_probe(tag, targets, sockets), "kernel": probes.kernel_probe(),
                       "proc": probes.proc_probe(),
                       "neighbour": probes.neighbour_probe(tag, [-1]).replace("[-1]", "__PIDS__")}}
    return _IN_SANDBOX.replace("__SPEC__", repr(json.dumps(spec)))


def breaches(report: dict[str, Any], tag: str) -> dict[str, list[str]]:
    """Every breach the container's report shows, by probe (empty lists: contained)."""
    found: dict[str, list[str]] = {}
    for mode in ("stateless", "session"):
        r = report[mode]
        checks = {"files": lambda s: probes.verdict_files(s, tag), "kernel": probes.verdict_kernel,
                  "proc": probes.verdict_proc, "neighbour": probes.verdict_neighbour}
        for name, verdict in checks.items():
            try:
                found[f"{mode} {name}"] = verdict(probes.parse(r[name]))
            except AssertionError as exc:
                found[f"{mode} {name}"] = [str(exc)]
        victim = r["victim"]
        found[f"{mode} victim undisturbed"] = [] if victim == "ready\nsurvived\n" else [repr(victim)]
    found["host sockets"] = [f"accepted a connection on {p}" for p in report["accepted"]]
    return found


_CPU_HOGS = r"""
import json, statistics, threading, time, urllib.request
URL = "http://sandbox:8080"
def post(path, body, timeout=180):
    req = urllib.request.Request(URL + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())
def health():
    return json.loads(urllib.request.urlopen(URL + "/healthz", timeout=30).read())
hogs = [threading.Thread(target=post, args=("/run_code", {"code": HOG, "run_timeout": RUN_S}))
        for _ in range(BUSY)]
[t.start() for t in hogs]
deadline = time.monotonic() + 60
while health()["in_flight"] < BUSY and time.monotonic() < deadline:
    time.sleep(0.1)
in_flight = health()["in_flight"]
times = []
for _ in range(5):
    start = time.monotonic()
    health()
    times.append(time.monotonic() - start)
hello = post("/run_code", {"code": "print('hello')", "run_timeout": 30})
print(json.dumps({"in_flight": in_flight, "healthz_s": times, "hello": hello["status"],
                  "hello_stdout": (hello.get("run_result") or {}).get("stdout")}))
[t.join() for t in hogs]
"""


def cpu_hogs(busy: int, run_s: float) -> str:
    return (_CPU_HOGS.replace("HOG", repr(probes.CPU_HOG)).replace("RUN_S", repr(run_s))
            .replace("BUSY", str(busy)))


def verdict_cpu(report: dict[str, Any], busy: int) -> list[str]:
    out = []
    if report["in_flight"] < busy:
        out.append(f"only {report['in_flight']} of {busy} hogs ran at once")
    times = sorted(report["healthz_s"])
    if times[len(times) // 2] >= 1.0 or times[-1] >= 5.0:
        out.append(f"/healthz took {times} s")
    if report["hello"] != "Success" or report["hello_stdout"] != "hello\n":
        out.append(f"hello: {report['hello']} {report['hello_stdout']!r}")
    return out


def report_of(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
