"""tests/helpers/budget_plugin.py in a throwaway pytest run (pytester): a test over its budget
fails with a message that says how to state a larger one; a slow marker raises the budget; a
malformed slow marker is a usage error; a test that failed is not failed again for its time."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

INI = """
[pytest]
test_budget_s = 0.3
asyncio_default_fixture_loop_scope = function
markers =
    slow(reason, budget_s): test
"""


@pytest.fixture
def run(pytester: pytest.Pytester):
    pytester.makeini(INI)

    def go(source: str) -> pytest.RunResult:
        pytester.makepyfile(test_budget=source)
        return pytester.runpytest("-p", "tests.helpers.budget_plugin", "-p", "no:cacheprovider")
    return go


def test_a_test_over_the_budget_fails_and_says_how_to_mark_it(run) -> None:
    result = run("import time\n\ndef test_sleepy():\n    time.sleep(0.8)\n\ndef test_quick():\n    pass\n")
    result.assert_outcomes(passed=2, errors=1)  # the slow test passed its call and fails at teardown
    result.stdout.fnmatch_lines([
        "*test_budget.py::test_sleepy took 0.* s (setup *, call 0.* s, teardown *), over the per-test "
        "budget (ini test_budget_s) of 0.3 s. Make it faster, or mark it "
        "@pytest.mark.slow(reason='why', budget_s=<seconds>)*",
    ])
    assert "test_quick took" not in result.stdout.str()


def test_setup_time_counts_toward_the_budget(run) -> None:
    result = run("import time, pytest\n\n@pytest.fixture\ndef warm():\n    time.sleep(0.8)\n\n"
                 "def test_uses_a_slow_fixture(warm):\n    pass\n")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_uses_a_slow_fixture took 0.* s (setup 0.* s, call *"])


def test_a_slow_marker_states_a_larger_budget_and_it_is_enforced(run) -> None:
    result = run("import time, pytest\n\n"
                 "@pytest.mark.slow(reason='sleeps', budget_s=5)\ndef test_within():\n    time.sleep(0.8)\n\n"
                 "@pytest.mark.slow(reason='sleeps', budget_s=0.2)\ndef test_over():\n    time.sleep(0.8)\n")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_over took 0.* s (*), over its slow marker's budget_s of 0.2 s*"])
    assert "test_within took" not in result.stdout.str()


@pytest.mark.parametrize("mark", ["@pytest.mark.slow", "@pytest.mark.slow(budget_s=9)",
                                  "@pytest.mark.slow(reason='', budget_s=9)",
                                  "@pytest.mark.slow(reason='x', budget_s=0)",
                                  "@pytest.mark.slow(reason='x', budget_s='9')", "@pytest.mark.slow('x', 9)"])
def test_a_malformed_slow_marker_stops_the_run_at_collection(run, mark: str) -> None:
    result = run(f"import pytest\n\n{mark}\ndef test_x():\n    pass\n")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_budget.py::test_x: @pytest.mark.slow *"])


def test_a_failing_test_is_not_failed_again_for_its_time(run) -> None:
    result = run("import time\n\ndef test_broken():\n    time.sleep(0.8)\n    assert False\n")
    result.assert_outcomes(failed=1)
    assert "took" not in result.stdout.str()
