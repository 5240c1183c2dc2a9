"""Tiny synchronous client for the sandbox tests."""

from __future__ import annotations

import os
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


def sandbox_pids(uid_base: int = 61000, uid_top: int = 61000 + 4096) -> list[int]:
    """Host pids of processes running as any sandbox uid."""
    pids = []
    for name in os.listdir("/proc"):
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
