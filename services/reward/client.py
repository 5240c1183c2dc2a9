"""Async client of the reward service (used by the rollout service)."""

from __future__ import annotations

from typing import Any

import httpx

from services.reward.schemas import ScoreResult


class RewardClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout_s)

    async def score(
        self, response: str, ground_truth: str, *, num_tool_calls: int = 0, data_source: str | None = None
    ) -> ScoreResult:
        r = await self._client.post(
            "/score",
            json={
                "response": response,
                "ground_truth": ground_truth,
                "num_tool_calls": num_tool_calls,
                "data_source": data_source,
            },
        )
        r.raise_for_status()
        return ScoreResult.model_validate(r.json())

    async def score_batch(self, items: list[dict[str, Any]]) -> list[ScoreResult]:
        r = await self._client.post("/score/batch", json={"items": items})
        r.raise_for_status()
        return [ScoreResult.model_validate(x) for x in r.json()["results"]]

    async def aclose(self) -> None:
        await self._client.aclose()
