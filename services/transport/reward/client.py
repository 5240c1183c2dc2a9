"""Async client of the reward service (used by the rollout service).

Invariants:
- overload is part of the contract: a 503 means "nothing was graded, come back after
  ``Retry-After`` seconds", and the client does exactly that, so a burst larger than the
  service's queue is graded late rather than dropped or mis-graded;
- one budget per call: connection errors, time-outs, 429 and 5xx are retried under the shared
  policy (``services/common/retry.py``: jittered pauses, or the server's ``Retry-After``) until
  ``timeout_s`` is spent, retries and waits included; each attempt gets the time left as its HTTP
  timeout. Every retry is counted in ``retries_counter`` (``target="reward"``, by reason);
- the last failure is raised as ``httpx.HTTPError`` (``HTTPStatusError`` for a status): callers
  never see the retry machinery, and nobody above retries again.
"""

from __future__ import annotations

from typing import Any

import httpx

from services.common.retry import RetryableStatus, RetryPolicy, check_status, retry_call
from services.transport.reward.schemas import ScoreResult


class RewardClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0, *, backoff_s: float = 0.2,
                 retries_counter: Any = None, client_kwargs: dict[str, Any] | None = None) -> None:
        """``client_kwargs``: extra ``httpx.AsyncClient`` arguments (bearer token header, TLS CA)."""
        self.timeout_s = timeout_s
        self.policy = RetryPolicy(attempts=None, deadline_s=timeout_s, base_s=backoff_s, max_s=5.0)
        self.retries_counter = retries_counter
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, **(client_kwargs or {}))

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        async def attempt(timeout: float | None) -> httpx.Response:
            return check_status(await self._client.post(path, json=body, timeout=timeout))

        try:
            r = await retry_call(attempt, self.policy, target="reward", counter=self.retries_counter)
        except RetryableStatus as exc:  # out of time: the last answer's status is the error
            exc.response.raise_for_status()
            raise
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
