"""Tiny synchronous client for the sandbox tests."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import httpx


def run_code(url: str, code: str, **fields: Any) -> dict[str, Any]:
    resp = httpx.post(f"{url}/run_code", json={"code": code, "language": "python", **fields}, timeout=120)
    resp.raise_for_status()
    return resp.json()


def stdout_of(result: dict[str, Any]) -> str:
    return (result.get("run_result") or {}).get("stdout") or ""


def stderr_of(result: dict[str, Any]) -> str:
    return (result.get("run_result") or {}).get("stderr") or ""


def sandbox_pids(under: int | None = None, uid_base: int = 61000, uid_top: int = 61000 + 4096) -> list[int]:
    """Host pids of processes running as any sandbox uid: below the service ``under`` (its runs
    only, whatever other sandboxes run on this host), else anywhere on the host."""
    pids = []
    names = [str(p) for p in descendants(under)] if under is not None else os.listdir("/proc")
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        if uid_base <= int(line.split()[1]) < uid_top:
                            pids.append(int(name))
                        break
        except OSError:
            continue
    return pids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of all its threads, recursively)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as fh:
                    kids = [int(p) for p in fh.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


def kill_runs_of(service_pid: int, uid_base: int = 61000) -> int:
    """SIGKILL the model-code processes of *this* service (not other sandboxes on the host)."""
    killed = 0
    for pid in descendants(service_pid):
        uid = uid_of(pid)
        if uid is not None and uid >= uid_base:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def open_session(url: str, **fields: Any) -> str:
    resp = httpx.post(f"{url}/sessions", json=fields, timeout=120)
    resp.raise_for_status()
    return resp.json()["session_id"]


def close_session(url: str, session_id: str) -> None:
    httpx.delete(f"{url}/sessions/{session_id}", timeout=120)


def run_in_session(url: str, code: str, **fields: Any) -> dict[str, Any]:
    """``run_code``'s result for ``code`` run as one cell of a fresh session (closed after)."""
    session = open_session(url, memory_limit_MB=fields.get("memory_limit_MB", -1))
    try:
        return run_code(url, code, session_id=session, **fields)
    finally:
        close_session(url, session)
