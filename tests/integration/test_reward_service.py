"""The reward service as a real subprocess on loopback: contract, batching, limits, errors."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from services.common.process import ServiceProcess
from services.reward.workers import WALL_FACTOR

pytestmark = pytest.mark.integration


LIMITS = ("--set", "max_response_chars=200000")


@pytest.fixture(scope="module")
def reward_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("reward") / "reward.log"
    with ServiceProcess(
        ["reward", "serve", *("--set", "workers=2", "--set", "timeout_s=1.5"), *LIMITS], log_path=str(log)
    ) as proc:
        yield proc.url


def test_math_verify_classes_through_the_service(reward_url):
    """Issue 37's classes over HTTP, with a wrong twin each (a false accept would be a reward hack)."""
    pairs = [
        ("Answer: 1000,99", "1000.99", True),
        ("Final Answer: The largest $n$ is 34.", "34", True),
        ("\\boxed{0.0833333333333333}", "\\frac{1}{12}", True),
        ("\\boxed{x \\in [-2,7]}", "-2 \\le x \\le 7", True),
        ("\\boxed{(5,2),(7,2)}", "p=5,q=2;p=7,q=2", True),
        ("Answer: 1000,98", "1000.99", False),
        ("Final Answer: The largest $n$ is 34.", "35", False),
        ("\\boxed{0.33}", "\\frac{1}{3}", False),
        ("\\boxed{x \\in [-2,7)}", "-2 \\le x \\le 7", False),
        ("\\boxed{(2,5),(2,7)}", "p=5,q=2;p=7,q=2", False),
    ]
    items = [{"response": r, "ground_truth": t} for r, t, _ in pairs]
    got = httpx.post(f"{reward_url}/score/batch", json={"items": items}, timeout=60).json()["results"]
    assert [g["correct"] for g in got] == [want for _, _, want in pairs]


def test_score_contract(reward_url):
    r = httpx.post(
        f"{reward_url}/score", json={"response": "so \\boxed{\\dfrac{1}{2}}", "ground_truth": "0.5"}
    )
    assert r.status_code == 200
    body = r.json()
    assert {"score", "correct", "extracted", "reason"} <= set(body)
    assert body["correct"] is True and body["score"] == 1.0 and body["extracted"] == "\\dfrac{1}{2}"
    wrong = httpx.post(
        f"{reward_url}/score",
        json={
            "response": "Answer: 100",
            "ground_truth": "1",
            "data_source": "math_dapo",
            "num_tool_calls": 3,
        },
    ).json()
    assert wrong == {
        "score": -1.0,
        "correct": False,
        "extracted": "100",
        "reason": "mismatch",
        "shaping": 0.0,
        "train": True,
    }
    none = httpx.post(f"{reward_url}/score", json={"response": "no idea", "ground_truth": "1"}).json()
    assert none["extracted"] is None and none["reason"] == "no_answer" and none["score"] == -1.0


def test_batch_of_512_in_order(reward_url):
    items = [{"response": f"Answer: {i}", "ground_truth": str(i if i % 3 else i + 1)} for i in range(512)]
    items[7] = {"response": "\\boxed{2\\sqrt{3}}", "ground_truth": "\\sqrt{12}"}
    r = httpx.post(f"{reward_url}/score/batch", json={"items": items}, timeout=60)
    results = r.json()["results"]
    assert len(results) == 512
    for i, res in enumerate(results):
        expected = True if i == 7 else bool(i % 3)
        assert res["correct"] is expected, (i, res)


def test_pathological_answer_times_out_and_service_stays_healthy(reward_url):
    start = time.monotonic()
    r = httpx.post(
        f"{reward_url}/score",
        json={"response": "\\boxed{10^{10^{10^{10}}}}", "ground_truth": "3x"},
        timeout=30,
    ).json()
    assert r["reason"] == "timeout" and r["correct"] is False
    assert r["score"] == -1.0 and r["train"] is True  # timeout_policy=incorrect, the default
    assert time.monotonic() - start < WALL_FACTOR * 1.5  # 1.5 CPU seconds; wall time stretches with load
    assert httpx.get(f"{reward_url}/healthz").json()["status"] == "ok"
    again = httpx.post(
        f"{reward_url}/score", json={"response": "\\boxed{x^2+2x+1}", "ground_truth": "(x+1)^2"}, timeout=30
    ).json()
    assert again["correct"] is True
    metrics = httpx.get(f"{reward_url}/metrics").text
    assert "reward_timeouts_total 1.0" in metrics
    assert "reward_symbolic_timeouts_total 1.0" in metrics
    assert 'reward_grades_total{reason="timeout"}' in metrics and "reward_grade_seconds_bucket" in metrics


def test_huge_expression_is_refused_at_once_and_oversized_fields_are_422(reward_url):
    huge = "+".join(["(x+1)^{20}"] * 10_000)  # ~100 KB expression inside a normal-sized response
    r = httpx.post(f"{reward_url}/score", json={"response": f"\\boxed{{{huge}}}", "ground_truth": "x"}).json()
    assert r["reason"] == "timeout" and r["correct"] is False and r["score"] == -1.0
    r = httpx.post(f"{reward_url}/score", json={"response": "x" * 200_001, "ground_truth": "1"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "response"]
    assert "max_response_chars=200000" in r.json()["detail"][0]["msg"]
    r = httpx.post(f"{reward_url}/score", json={"response": "Answer: 1", "ground_truth": "1" * 10_001})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "ground_truth"]
    items = [{"response": "Answer: 1", "ground_truth": "1"}, {"response": "x" * 200_001, "ground_truth": "1"}]
    r = httpx.post(f"{reward_url}/score/batch", json={"items": items})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "items", 1, "response"]
    assert httpx.get(f"{reward_url}/healthz").json()["status"] == "ok"


@pytest.mark.parametrize(
    "body,field",
    [
        ({"ground_truth": "1"}, "response"),
        ({"response": "x"}, "ground_truth"),
        ({"response": "x", "ground_truth": ""}, "ground_truth"),
        ({"response": "x", "ground_truth": "1", "num_tool_calls": -1}, "num_tool_calls"),
        ({"response": 5, "ground_truth": "1"}, "response"),
    ],
)
def test_bad_input_is_422_naming_the_field(reward_url, body, field):
    r = httpx.post(f"{reward_url}/score", json=body)
    assert r.status_code == 422
    assert any(field in d["loc"] for d in r.json()["detail"])


def test_bad_batch_item_names_its_index(reward_url):
    r = httpx.post(
        f"{reward_url}/score/batch",
        json={"items": [{"response": "a", "ground_truth": "1"}, {"response": "b"}]},
    )
    assert r.status_code == 422
    assert ["body", "items", 1, "ground_truth"] in [d["loc"] for d in r.json()["detail"]]


def test_cli_grade_prints_json():
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "reward",
            "grade",
            "--response",
            "Answer: $-3$",
            "--ground-truth",
            "-3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["correct"] is True


async def test_python_client_round_trip(reward_url):
    from services.transport.reward.client import RewardClient

    client = RewardClient(reward_url)
    try:
        one = await client.score("<answer>\\boxed{2\\sqrt{3}}</answer>", "\\sqrt{12}", num_tool_calls=2)
        assert one.correct is True and one.reason == "equivalent" and one.extracted == "2\\sqrt{3}"
        many = await client.score_batch(
            [
                {"response": "Answer: 6.28", "ground_truth": "2\\pi"},
                {"response": "Answer: 7", "ground_truth": "7"},
            ]
        )
        assert [(r.correct, r.reason) for r in many] == [(False, "mismatch"), (True, "exact")]
    finally:
        await client.aclose()


CASES = [json.loads(line) for line in (Path(__file__).parents[1] / "data" / "reward_cases.jsonl").open()]


def _grades(results: list[dict]) -> list[tuple[bool, str, str | None]]:
    return [(r["correct"], r["reason"], r["extracted"]) for r in results]


async def test_grades_are_the_same_in_one_burst_and_one_by_one(reward_url):
    """The whole labelled set as one batch, as concurrent single requests, and one at a time.

    With 2 workers, the burst queues hundreds of symbolic checks; waiting must never turn
    into a timeout or any other grade (the limit counts work, not waiting).
    """
    items = [{"response": c["response"], "ground_truth": c["ground_truth"]} for c in CASES]
    async with httpx.AsyncClient(base_url=reward_url, timeout=300) as client:
        r = await client.post("/score/batch", json={"items": items})
        assert r.status_code == 200
        burst = _grades(r.json()["results"])
        singles = await asyncio.gather(*(client.post("/score", json=item) for item in items))
        concurrent = _grades([s.json() for s in singles])
        sequential = []
        for item in items:
            sequential.append((await client.post("/score", json=item)).json())
    assert burst == concurrent == _grades(sequential)
    assert [g[0] for g in burst] == [c["correct"] for c in CASES]  # and they are the labels
    assert all(g[1] != "timeout" for g in burst)


@pytest.fixture(scope="module")
def tiny_queue_url(tmp_path_factory):
    """One worker, room for two checks: overload is easy to reach."""
    log = tmp_path_factory.mktemp("reward") / "reward-tiny-queue.log"
    args = ("--set", "workers=1", "--set", "timeout_s=1", "--set", "max_queue=2")
    with ServiceProcess(["reward", "serve", *args], log_path=str(log)) as proc:
        yield proc.url


async def test_overload_is_a_503_with_retry_after_and_the_client_waits_it_out(tiny_queue_url):
    from services.transport.reward.client import RewardClient

    hang = {"response": "\\boxed{10^{10^{10^{10}}}}", "ground_truth": "3x"}  # 1 CPU second of work
    symbolic = [{"response": f"\\boxed{{x^2+{k}x}}", "ground_truth": f"x(x+{k})"} for k in range(1, 4)]
    async with httpx.AsyncClient(base_url=tiny_queue_url, timeout=60) as client:
        busy = asyncio.create_task(client.post("/score", json=hang))
        deadline = time.monotonic() + 30
        while (await client.get("/healthz")).json()["admitted"] == 0:  # the hang holds the worker
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        r = await client.post("/score/batch", json={"items": symbolic})  # 1 + 3 > max_queue=2
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert "max_queue=2" in r.json()["detail"]
        fast = await client.post("/score", json={"response": "Answer: 7", "ground_truth": "7"})
        assert fast.json()["correct"] is True  # the fast path never queues, never refused
        rc = RewardClient(tiny_queue_url, timeout_s=60)
        try:
            results = await rc.score_batch(symbolic)  # retried after Retry-After until admitted
        finally:
            await rc.aclose()
        assert [(x.correct, x.reason) for x in results] == [(True, "equivalent")] * 3
        assert (await busy).json()["reason"] == "timeout"
        metrics = (await client.get("/metrics")).text
    refused = re.search(r"^reward_overloaded_total (\S+)$", metrics, re.M)
    assert refused is not None and float(refused.group(1)) >= 1  # ours, and the client's retries
    assert "reward_symbolic_wait_seconds_total" in metrics and "reward_symbolic_admitted 0.0" in metrics
