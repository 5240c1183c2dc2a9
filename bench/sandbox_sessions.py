"""Live interpreter sessions vs cell replay, on one sandbox service, in one run.

A notebook-style trajectory sends one new cell per turn. Three ways to give turn ``t`` the
state of turns ``1..t-1``, all against the same real sandbox service on loopback:

- ``session``: ours. ``POST /sessions`` once, then each turn sends only its new cell
  (``/run_code`` with ``session_id``), ``DELETE`` at the end;
- ``jupyter-replay``: SandboxFusion's ``/run_jupyter`` semantics, the baseline. Each turn sends
  every cell so far, which run again in a fresh interpreter;
- ``code-replay``: a stateless client's emulation. Each turn sends all cells so far joined
  into one program to ``/run_code``.

Prints, per mode: the time of a whole trajectory (all turns, median over trajectories), of
its last turn, and the ratio replay/session; and whether state stayed right (a random number
drawn in turn 1 must read the same in the last turn: replay draws it anew every time).

Usage: ``python bench/sandbox_sessions.py [--turns 8] [--trajectories 5] [--out result.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.sandbox.launcher import SandboxProcess  # noqa: E402

FIRST = ("import numpy as np, sympy as sp\nrng = np.random.default_rng()\nfirst_draw = float(rng.random())\n"
         "data = rng.normal(size=200_000)\nx = sp.symbols('x')\nprint(repr(first_draw))")


def cells(turns: int) -> list[str]:
    """Turn 1 sets up data; each later turn does a little numeric and symbolic work on it."""
    out = [FIRST]
    for k in range(1, turns - 1):
        out.append(f"s{k} = float(np.sort(data)[{k}])\nr{k} = sp.solve(x**2 - {k + 1}, x)\n"
                   f"t{k} = sum(i * i for i in range(100_000))\nprint(round(s{k}, 3), r{k})")
    out.append("first_draw")
    return out


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json=body, timeout=300)
    r.raise_for_status()
    return r.json()


# per-turn seconds; turn 1's random draw as turn 1 showed it; the same variable as the last turn sees it
Views = tuple[list[float], str, str]


def run_session(client: httpx.Client, all_cells: list[str]) -> Views:
    """Opening the session counts in turn 1, closing it in the last turn."""
    start = time.perf_counter()
    sid = _post(client, "/sessions", {})["session_id"]
    opened = time.perf_counter() - start
    times, outs = [], []
    try:
        for cell in all_cells:
            start = time.perf_counter()
            body = _post(client, "/run_code", {"code": cell, "session_id": sid, "run_timeout": 60})
            times.append(time.perf_counter() - start)
            assert body["status"] == "Success", body
            outs.append(body["run_result"]["stdout"].strip())
    finally:
        start = time.perf_counter()
        client.delete(f"/sessions/{sid}").raise_for_status()
        closed = time.perf_counter() - start
    times[0] += opened
    times[-1] += closed
    return times, outs[0], outs[-1]


def run_jupyter_replay(client: httpx.Client, all_cells: list[str]) -> Views:
    times, first, last = [], "", ""
    for t in range(1, len(all_cells) + 1):
        start = time.perf_counter()
        request = {"cells": all_cells[:t], "cell_timeout": 60, "total_timeout": 300}
        body = _post(client, "/run_jupyter", request)
        times.append(time.perf_counter() - start)
        assert body["status"] == "Success", body
        if t == 1:
            first = body["cells"][0]["stdout"].strip()
        display = body["cells"][-1]["display"]
        last = display[0]["text/plain"] if display else ""
    return times, first, last


def run_code_replay(client: httpx.Client, all_cells: list[str]) -> Views:
    times, outs = [], []
    for t in range(1, len(all_cells) + 1):
        # a script prints nothing for a bare last expression: print it, as the notebook would show it
        last = all_cells[t - 1] if t < len(all_cells) else "print(repr(first_draw))"
        program = "\n".join([*all_cells[: t - 1], last])
        start = time.perf_counter()
        body = _post(client, "/run_code", {"code": program, "language": "python", "run_timeout": 60})
        times.append(time.perf_counter() - start)
        assert body["status"] == "Success", body
        outs.append(body["run_result"]["stdout"].strip().splitlines()[-1])
    return times, outs[0], outs[-1]


MODES = {"session": run_session, "jupyter-replay": run_jupyter_replay, "code-replay": run_code_replay}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--trajectories", type=int, default=5)
    parser.add_argument("--out", default="", help="write the results here as JSON")
    args = parser.parse_args(argv)
    all_cells = cells(args.turns)
    sb_args = ["--set", "max_concurrency=4", "--set", "zygotes=1", "--set", "light_zygotes=1",
               "--set", "heavy_zygotes=0", "--set", "max_sessions=8"]
    results: dict[str, Any] = {"turns": args.turns, "trajectories": args.trajectories, "modes": {}}
    with SandboxProcess(sb_args) as sb, httpx.Client(base_url=sb.url) as client:
        _post(client, "/run_code", {"code": "import numpy, sympy", "language": "python"})  # warm up
        for mode, fn in MODES.items():
            totals, lasts, kept = [], [], 0
            for _ in range(args.trajectories):
                times, first_view, last_view = fn(client, all_cells)
                totals.append(sum(times))
                lasts.append(times[-1])
                kept += int(first_view == last_view)  # the last turn saw turn 1's draw, not a new one
            results["modes"][mode] = {"trajectory_s_median": statistics.median(totals),
                                      "last_turn_s_median": statistics.median(lasts),
                                      "state_kept": f"{kept}/{args.trajectories}"}
    base = results["modes"]["session"]
    print(f"{args.turns} turns per trajectory, {args.trajectories} trajectories, one sandbox service")
    print(f"{'mode':<16}{'trajectory s':>14}{'last turn s':>13}{'x session':>11}  state kept")
    for mode, r in results["modes"].items():
        ratio = r["trajectory_s_median"] / base["trajectory_s_median"]
        r["trajectory_ratio_vs_session"] = ratio
        r["last_turn_ratio_vs_session"] = r["last_turn_s_median"] / base["last_turn_s_median"]
        print(f"{mode:<16}{r['trajectory_s_median']:>14.3f}{r['last_turn_s_median']:>13.3f}{ratio:>10.2f}x"
              f"  {r['state_kept']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
