"""Async client of the reward service (used by the rollout service).

Overload is part of the contract: a 503 means "nothing was graded, come back after
``Retry-After`` seconds", and the client does exactly that until its ``timeout_s`` is spent,
so a burst larger than the service's queue is graded late rather than dropped or mis-graded.
Any other error is raised to the caller.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from services.transport.reward.schemas import ScoreResult

MAX_RETRY_AFTER_S = 30.0


def retry_after_s(response: httpx.Response, default: float = 1.0) -> float:
    """The ``Retry-After`` delay in seconds (integer form), ``default`` when absent or odd."""
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(response.headers.get("Retry-After", default))))
    except ValueError:
        return default


class RewardClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0,
                 client_kwargs: dict[str, Any] | None = None) -> None:
        """``client_kwargs``: extra ``httpx.AsyncClient`` arguments (bearer token header, TLS CA)."""
        self.timeout_s = timeout_s
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, **(client_kwargs or {}))

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST, waiting out 503s as told by ``Retry-After`` within ``timeout_s`` overall."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            r = await self._client.post(path, json=body)
            if r.status_code != 503:
                break
            delay = retry_after_s(r)
            if time.monotonic() + delay >= deadline:
                break  # out of time: the 503 is raised below
            await asyncio.sleep(delay)
        r.raise_for_status()
        return r

    async def score(
        self, response: str, ground_truth: str, *, num_tool_calls: int = 0, data_source: str | None = None
    ) -> ScoreResult:
        r = await self._post(
            "/score",
            {
                "response": response,
                "ground_truth": ground_truth,
                "num_tool_calls": num_tool_calls,
                "data_source": data_source,
            },
        )
        return ScoreResult.model_validate(r.json())

    async def score_batch(self, items: list[dict[str, Any]]) -> list[ScoreResult]:
        r = await self._post("/score/batch", {"items": items})
        return [ScoreResult.model_validate(x) for x in r.json()["results"]]

    async def aclose(self) -> None:
        await self._client.aclose()
