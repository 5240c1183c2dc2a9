"""Send prompt jobs to rollout replicas over ``POST /v1/rollouts`` and collect their groups.

Invariant: ``groups[i]`` answers ``jobs[i]`` (whatever order the replies arrive in); job ``i``
goes to replica ``i mod len(urls)``; at most ``concurrency`` requests are in flight; no request
id is sent (the service draws a unique one, so two clients may send the same dataset at once);
a non-2xx reply raises with the replica's URL and body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from services.common.schemas import Group, PromptJob


def request_body(job: PromptJob) -> dict[str, Any]:
    body = {
        "messages": [m.model_dump(exclude_none=True) for m in job.messages] if job.messages else None,
        "prompt_ids": job.prompt_ids,
        "ground_truth": job.ground_truth,
        "data_source": job.data_source,
        "n": job.n,
        "sampling": job.sampling.model_dump(exclude_none=True),
        "max_turns": job.max_turns,
    }
    return {k: v for k, v in body.items() if v is not None}


class RolloutHTTPError(RuntimeError):
    pass


async def rollout_groups(
    urls: Sequence[str],
    jobs: Sequence[PromptJob],
    *,
    concurrency: int = 32,
    on_group: Callable[[PromptJob, Group], None] | None = None,
    timeout_s: float | None = None,
    client_kwargs: dict[str, Any] | None = None,
) -> list[Group]:
    """``client_kwargs``: extra ``httpx.AsyncClient`` arguments (the bearer token header and the CA of
    ``ClientSecurity.httpx_kwargs``)."""
    if not urls:
        raise ValueError("rollout_groups: at least one rollout URL is required")
    sem = asyncio.Semaphore(concurrency)
    out: list[Group | None] = [None] * len(jobs)

    async def one(i: int, job: PromptJob, client: httpx.AsyncClient) -> None:
        url = urls[i % len(urls)].rstrip("/")
        async with sem:
            r = await client.post(f"{url}/v1/rollouts", json=request_body(job))
        if r.status_code >= 300:
            raise RolloutHTTPError(f"{url}/v1/rollouts answered {r.status_code} for job "
                                   f"{job.job_id!r}: {r.text[:500]}")
        group = Group.model_validate(r.json())
        out[i] = group
        if on_group is not None:
            on_group(job, group)

    async with httpx.AsyncClient(timeout=timeout_s, **(client_kwargs or {})) as client:
        await asyncio.gather(*(one(i, job, client) for i, job in enumerate(jobs)))
    return [g for g in out if g is not None]
