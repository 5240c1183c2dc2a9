import asyncio
import time

import pytest

from services.reward.config import RewardConfig, ShapingConfig
from services.reward.exact import to_fraction
from services.reward.extract import extract_answer
from services.reward.grader import Grader, Verdict, fast_grade
from services.reward.normalize import normalize
from services.reward.scoring import score


@pytest.mark.parametrize(
    "raw,norm",
    [
        ("$\\dfrac{1}{2}$", "\\frac{1}{2}"),
        ("\\left( 3 \\right)", "(3)"),
        ("x = 5.", "5"),
        ("1,000", "1000"),
        ("\\text{Monday}", "monday"),
        ("12\\,345", "12345"),
        ("30^{\\circ}", "30"),
        ("\\$4.50", "4.50"),
        ("1,5", "1,5"),
        ("x+y=5", "x+y=5"),
        ("(C)", "c"),
    ],
)
def test_normalize(raw, norm):
    assert normalize(raw) == norm


def test_exact_fast_path_values():
    assert to_fraction("\\frac{3}{4}") == to_fraction("0.75") == to_fraction("3/4")
    assert to_fraction("-\\frac12") == to_fraction("-0.5")
    assert to_fraction("1.5\\times10^{3}") == 1500
    assert to_fraction("10^{10^{10}}") is None  # never evaluate powers here
    assert to_fraction("1e999999") is None  # bounded exponent
    assert to_fraction("1/0") is None


def test_integer_ground_truths_never_reach_the_symbolic_path():
    for response, truth in (("Answer: 34", "34"), ("\\boxed{113}", "113"), ("Answer: 7", "-3")):
        assert isinstance(fast_grade(response, truth), Verdict)


def test_extraction_ignores_tool_blocks_and_takes_the_last_answer():
    assert extract_answer("<interpreter>Answer: 1</interpreter> so \\boxed{2}") == "2"
    assert extract_answer("\\boxed{\\frac{a}{\\sqrt{b}}} text") == "\\frac{a}{\\sqrt{b}}"
    assert extract_answer("nothing here") is None


def test_score_policy_and_optional_shaping():
    cfg = RewardConfig()
    right, wrong, none = (
        Verdict(True, "1", "exact"),
        Verdict(False, "2", "mismatch"),
        Verdict(False, None, "no_answer"),
    )
    assert score(right, 3, cfg) == (1.0, 0.0)
    assert score(wrong, 3, cfg) == (-1.0, 0.0)  # shaping off by default
    shaped = cfg.model_copy(update={"shaping": ShapingConfig(tool_bonus=True, format_penalty=-0.5)})
    assert score(wrong, 2, shaped) == pytest.approx((-0.8, 0.2))
    assert score(wrong, 9, shaped) == pytest.approx((-0.6, 0.4))  # capped at -0.6
    assert score(none, 0, shaped) == pytest.approx((-1.5, -0.5))
    assert score(right, 9, shaped) == (1.0, 0.0)


async def test_pathological_inputs_time_out_fast_and_the_pool_recovers():
    grader = Grader(workers=1, timeout_s=1.0)
    await grader.start()
    try:
        towers = ("10^{10^{10^{10}}}", "2^{3^{4^{5^{6}}}}+1")
        for answer in towers:
            start = time.monotonic()
            verdict = await grader.grade(f"\\boxed{{{answer}}}", "x^2+1")
            assert verdict.reason == "timeout" and not verdict.correct
            assert time.monotonic() - start < 1.5
        assert grader.pool.timeouts == 2
        huge = "+".join(["(x+1)^{20}"] * 10_000)  # ~100 KB: incorrect, decided or cut off in time
        start = time.monotonic()
        verdict = await grader.grade(f"\\boxed{{{huge}}}", "x^2+1")
        assert not verdict.correct and verdict.reason in ("timeout", "mismatch")
        assert time.monotonic() - start < 1.5
        for _ in range(200):  # replacements start in the background
            if grader.pool.idle == 1:
                break
            await asyncio.sleep(0.05)
        assert grader.pool.idle == 1
        ok = await asyncio.wait_for(grader.grade("\\boxed{\\sqrt{12}}", "2\\sqrt{3}"), 10)
        assert ok.correct and ok.reason == "equivalent"
    finally:
        await grader.stop()


async def test_stopping_the_grader_leaves_no_worker_behind():
    grader = Grader(workers=1, timeout_s=0.5)
    await grader.start()
    pids = {w.proc.pid for w in grader.pool._all}
    await grader.grade("\\boxed{10^{10^{10^{10}}}}", "3")  # times out; replacement starts in background
    await grader.stop()  # while the replacement may still be starting
    await asyncio.sleep(0.5)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(") ", 1)[1][:1]
        except FileNotFoundError:
            continue  # gone: good
        assert state == "Z", f"worker {pid} still running (state {state})"
