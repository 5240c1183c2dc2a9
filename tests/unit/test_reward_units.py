import asyncio
import time
from fractions import Fraction

import pytest

from services.reward.config import RewardConfig, ShapingConfig
from services.reward.exact import compare_structures, to_fraction, to_structure
from services.reward.extract import extract_answer
from services.reward.grader import Grader, Verdict, fast_grade
from services.reward.normalize import normalize
from services.reward.scoring import score
from services.reward.shape import align


@pytest.mark.parametrize(
    "raw,norm",
    [
        ("$\\dfrac{1}{2}$", "\\frac{1}{2}"),
        ("\\left( 3 \\right)", "(3)"),
        ("x = 5.", "x=5"),
        ("1,000", "1000"),
        ("\\text{Monday}", "monday"),
        ("12\\,345", "12345"),
        ("30^{\\circ}", "30"),
        ("\\$4.50", "4.50"),
        ("1,5", "1,5"),
        ("x+y=5", "x+y=5"),
        ("(C)", "c"),
        ("\\pi r^2", "\\pi r^2"),  # the space after a macro name stays: not "\\pir^2"
        ("2 \\cdot x", "2\\cdot x"),
        ("\\sqrt 3", "\\sqrt{3}"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\frac{1}2", "\\frac{1}{2}"),
        ("\\log_2 8", "\\log_{2}8"),
        ("\\varnothing", "\\emptyset"),
        ("x \\in [1, 2]", "x\\in[1,2]"),
        ("32, 349", "32,349"),  # a list of two, never 32349
        ("32,349", "32349"),
        ("32,\\! 349", "32349"),  # MATH's thousands comma
        ("1,5", "1,5"),
        ("1,0000", "1,0000"),  # groups of exactly 3 digits only
        ("x <= 5", "x\\leq5"),
        ("5 \\ge x", "5\\geq x"),
        ("4\\pi \\text{ cm}^2", "4\\pi"),
        ("125\\textnormal{ miles}", "125"),
        ("28 percent", "28"),
        ("6 \\text{ and } 8", "6,8"),
        ("{-2, 2}", "-2,2"),
    ],
)
def test_normalize(raw, norm):
    assert normalize(raw) == norm


def test_leading_variables_must_agree():
    assert align("y=2x+1", "2x+1") == ("2x+1", "2x+1")
    assert fast_grade("\\boxed{y=3}", "x=3").reason == "mismatch"
    assert fast_grade("\\boxed{x=3}", "x = 3").correct
    assert fast_grade("\\boxed{3}", "x=3").correct


def test_exact_fast_path_values():
    assert to_fraction("\\frac{3}{4}") == to_fraction("0.75") == to_fraction("3/4")
    assert to_fraction("-\\frac12") == to_fraction("-0.5")
    assert to_fraction("1.5\\times10^{3}") == 1500
    assert to_fraction("10^{10^{10}}") is None  # never evaluate powers here
    assert to_fraction("1e999999") is None  # bounded exponent
    assert to_fraction("1/0") is None


# (pred, truth, expected): expected is None where the fast path must leave it to sympy.
STRUCTURES = [
    ("1,2,3", "3,2,1", True),
    ("\\{1,2\\}", "2,1", True),
    ("\\{\\frac{1}{2},3\\}", "\\{3,0.5\\}", True),
    ("[0,\\frac{1}{2}]", "[0,0.5]", True),
    ("(3,4)", "(3,4)", True),
    ("(3)", "3", True),
    ("(4,3)", "(3,4)", False),
    ("[1,2]", "[1,3]", False),
    ("1,2", "1,2,3", False),
    ("2", "2,-2", False),
    ("(1,2)", "2", False),
    ("[1,2]", "[1,2)", False),  # openness differs
    ("(1,2)", "[1,2]", False),  # an open interval (or a pair) is not a closed interval
    ("(1,2,3)", "[1,2,3]", None),  # no interval: the symbolic path reads both as sequences
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}", True),
    ("\\begin{pmatrix}0.5&1\\end{pmatrix}", "\\begin{pmatrix}\\frac{1}{2}&1\\end{pmatrix}", True),
    ("\\begin{pmatrix}1&2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", False),  # row vs column
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "(1,2,3,4)", False),
    ("\\begin{pmatrix}2\\end{pmatrix}", "2", False),
    ("\\begin{pmatrix}x&2\\end{pmatrix}", "\\begin{pmatrix}x&2\\end{pmatrix}", None),  # not all numbers
    ("11:21", "22:42", True),
    ("(1,2)", "1,2", None),  # tuple vs unordered list
    ("1,1,2", "1,2", None),  # duplicates
    ("(-\\infty,3]", "(-\\infty,3]", True),
    ("(-\\infty,3]", "(\\infty,3]", False),
    ("(1,\\pi)", "(1,\\pi)", None),  # not all numbers
    ("(1,2),(3,4)", "(1,2),(3,4)", None),
    ("\\{1\\}\\cup\\{2\\}", "\\{1,2\\}", None),
]


@pytest.mark.parametrize("pred,truth,expected", STRUCTURES)
def test_structure_fast_path_decides_only_what_it_is_sure_of(pred, truth, expected):
    assert compare_structures(to_structure(pred), to_structure(truth)) is expected


def test_structure_fast_path_agrees_with_the_symbolic_path():
    from services.reward.symbolic import symbolic_equal

    for pred, truth, expected in STRUCTURES:
        if expected is not None:
            assert symbolic_equal(pred, truth) is expected, (pred, truth)


def test_integer_ground_truths_never_reach_the_symbolic_path():
    cases = (("Answer: 34", "34", True), ("\\boxed{113}", "113", True), ("Answer: 7", "-3", False),
             ("\\boxed{\\frac{226}{2}}", "113", True), ("Answer: 0.5", "1", False))
    for response, truth, correct in cases:
        verdict = fast_grade(response, truth)
        assert isinstance(verdict, Verdict) and verdict.correct is correct, (response, truth, verdict)


def test_answer_length_cap_scales_with_a_long_ground_truth():
    truth = "+".join(f"x^{{{k}}}" for k in range(200))  # ~1.2 KB ground truth
    assert fast_grade("\\boxed{" + "1" * 1001 + "}", "3").reason == "timeout"
    assert fast_grade("\\boxed{" + "1" * 1000 + "}", "3").reason == "mismatch"
    assert not isinstance(fast_grade(f"\\boxed{{{truth}+1}}", truth), Verdict)  # goes on to sympy


# Responses that made a naive extractor quadratic (minutes of event-loop time at ~1 MB).
ADVERSARIAL = {
    "unclosed boxes": "\\boxed{" * 150_000,
    "unclosed answer tags": "<answer>" * 120_000,
    "many answer tags": "<answer>\\boxed{1}</answer>" * 30_000,
    "bare boxes": "\\boxed " * 130_000,
    "answer line with a space run": "Answer: a" + " " * 900_000 + "x",
    "final answer with a space run": "The final answer is a" + " " * 900_000 + "x",
    "many answer heads": "answer" + " " * 900_000,
    "many brace groups": "{}" * 450_000 + "\\boxed{1}",
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_extraction_is_linear_on_adversarial_responses(name):
    start = time.monotonic()
    fast_grade(ADVERSARIAL[name], "3")
    assert time.monotonic() - start < 3.0  # quadratic versions took minutes; this is a hang check


def test_extraction_ignores_tool_blocks_and_takes_the_last_answer():
    assert extract_answer("<interpreter>Answer: 1</interpreter> so \\boxed{2}") == "2"
    assert extract_answer("\\boxed{\\frac{a}{\\sqrt{b}}} text") == "\\frac{a}{\\sqrt{b}}"
    assert extract_answer("nothing here") is None
    for text in ("So ANSWER: $7$", "Ünïcode — ∑ so ANSWER: $7$", "İ answer: 7"):  # ASCII and non-ASCII scans
        assert extract_answer(text) == "7"
    assert extract_answer("The final answer is:\n\n$\\frac{1}{2}$. I hope it is correct.") == "\\frac{1}{2}"
    assert extract_answer("reanswer: 3") is None  # "answer" must start a word


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
    """The limit is 1 CPU second of work; wall time may stretch with load, up to the backstop."""
    grader = Grader(workers=1, timeout_s=1.0)
    await grader.start()
    try:
        towers = ("10^{10^{10^{10}}}", "2^{3^{4^{5^{6}}}}+1")
        for answer in towers:
            start = time.monotonic()
            verdict = await grader.grade(f"\\boxed{{{answer}}}", "x^2+1")
            assert verdict.reason == "timeout" and not verdict.correct
            assert time.monotonic() - start < grader.pool.wall_limit_s
        assert grader.pool.timeouts == 2 and grader.pool.stats.wall_timeouts == 0
        assert 2 * 1.0 <= grader.pool.stats.cpu_seconds < 2 * 1.25  # each stopped at its CPU second
        huge = "+".join(["(x+1)^{20}"] * 10_000)  # ~100 KB: refused before any parsing
        verdict = await grader.grade(f"\\boxed{{{huge}}}", "x^2+1")
        assert not verdict.correct and verdict.reason == "timeout"
        assert grader.pool.timeouts == 2  # never reached a worker
        for _ in range(400):  # replacements start in the background
            if grader.pool.idle == 1:
                break
            await asyncio.sleep(0.05)
        assert grader.pool.idle == 1
        ok = await asyncio.wait_for(grader.grade("\\boxed{\\sqrt{12}}", "2\\sqrt{3}"), 30)
        assert ok.correct and ok.reason == "equivalent"
    finally:
        await grader.stop()


async def test_waiting_for_a_worker_never_counts_against_the_limit():
    """One worker, busy for a full limit with a hang; the checks queued behind it still pass."""
    grader = Grader(workers=1, timeout_s=1.0)
    await grader.start()
    try:
        hang = asyncio.create_task(grader.grade("\\boxed{10^{10^{10^{10}}}}", "3x"))
        await asyncio.sleep(0.05)  # the hang has the worker now
        queued = [(f"\\boxed{{x^2+{k}x}}", f"x(x+{k})") for k in range(1, 9)]
        verdicts = await asyncio.gather(*(grader.grade(r, t) for r, t in queued))
        assert (await hang).reason == "timeout"
        assert [(v.correct, v.reason) for v in verdicts] == [(True, "equivalent")] * len(queued)
        assert grader.pool.stats.wait_seconds >= 0.9  # they did wait about a full limit
        assert grader.pool.timeouts == 1
    finally:
        await grader.stop()


def test_cpu_seconds_reads_a_real_process():
    import os

    from services.reward.workers import cpu_seconds

    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # burn some CPU in this process
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None and after > before
    assert cpu_seconds(2**22 + 12345) is None  # no such process


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


async def test_a_cancelled_caller_never_loses_a_worker_and_identical_checks_share_one():
    grader = Grader(workers=1, timeout_s=2.0)
    await grader.start()
    try:
        caller = asyncio.create_task(grader.grade("\\boxed{\\sin^2 x+\\cos^2 x}", "1"))
        await asyncio.sleep(0.01)  # its request is with the worker now
        caller.cancel()
        same = await asyncio.gather(*(grader.grade("\\boxed{\\sqrt{12}}", "2\\sqrt{3}") for _ in range(20)))
        assert all(v.correct and v.reason == "equivalent" for v in same)
        assert grader.pool.timeouts == 0 and grader.pool.idle == 1
    finally:
        await grader.stop()


@pytest.mark.parametrize(
    "expr,expected",
    [
        ("\\sqrt{16}", Fraction(4)),
        ("3\\sqrt{4}", Fraction(6)),
        ("-\\sqrt{9}", Fraction(-3)),
        ("\\sqrt{12}", "irrational"),
        ("2\\sqrt{3}", "irrational"),
        ("\\log_{2}8", Fraction(3)),
        ("\\log_2 8", Fraction(3)),
        ("\\log_{8}2", Fraction(1, 3)),
        ("\\log_{4}8", Fraction(3, 2)),
        ("\\log_{27}{9}", Fraction(2, 3)),
        ("\\log_{3}10", "irrational"),
        ("\\log_{6}36", Fraction(2)),
        ("\\log_{5}1", Fraction(0)),
        ("\\log_{12}{144}", Fraction(2)),
        ("\\log_{2}{3}", "irrational"),
        ("\\ln 1", Fraction(0)),
        ("\\ln8", "irrational"),
        ("\\log_{1}5", None),
        ("\\sqrt{x}", None),
        ("\\log_{2}x", None),
    ],
)
def test_exact_special_values(expr, expected):
    from services.reward import exact_special

    assert exact_special.value(expr) == expected


def test_exact_special_agrees_with_sympy():
    """Every exact decision must match the symbolic path on the same pair."""
    from services.reward.symbolic import symbolic_equal

    pairs = [
        ("\\log_{4}8", "1.5"),
        ("\\log_{8}2", "\\frac{1}{3}"),
        ("\\sqrt{49}", "7"),
        ("\\log_{2}{3}", "2"),
        ("\\ln 8", "3"),
        ("2\\sqrt{3}", "3"),
        ("\\log_{27}{9}", "0.6"),
        ("2\\pi", "\\pi\\cdot2"),
        ("\\frac{3\\pi}{2}", "3\\pi/2"),
        ("\\frac{\\pi}{4}", "0.25\\pi"),
        ("\\frac{3}{2}\\pi", "\\frac{3\\pi}{2}"),
        ("\\pi", "3.14"),
        ("3.14159", "\\pi"),
        ("4\\pi", "2\\pi"),
        ("-\\pi", "\\pi"),
        ("0\\pi", "0"),
    ]
    for pred, truth in pairs:
        fast = fast_grade(f"\\boxed{{{pred}}}", truth)
        assert isinstance(fast, Verdict), pred
        assert fast.correct == symbolic_equal(pred, truth), (pred, truth)
