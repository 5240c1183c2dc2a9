"""A pytest plugin: every test has a time budget, 300 s unless it says otherwise.

Invariant: a test whose setup + call + teardown took longer than its budget fails at teardown,
with a message that names the test, the time of each phase and how to state a larger budget.
The budget is the ini option ``test_budget_s`` (300), or the ``budget_s`` of the test's
``@pytest.mark.slow(reason=..., budget_s=...)``, which must also say why it is slow. A new slow
test is then a conscious choice (issue #32). A test that already failed is not failed twice.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
from _pytest.reports import TestReport

DEFAULT_BUDGET_S = 300.0
_SPENT = pytest.StashKey[dict[str, float]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("test_budget_s", "seconds one test may take without a slow marker "
                  f"(default {DEFAULT_BUDGET_S:.0f})", default=str(DEFAULT_BUDGET_S))


def slow_budget(nodeid: str, mark: pytest.Mark) -> float:
    """The budget a ``slow`` marker states; without a reason or a positive budget it is a usage
    error that names the test."""
    reason, budget = mark.kwargs.get("reason"), mark.kwargs.get("budget_s")
    if mark.args or not isinstance(reason, str) or not reason.strip():
        raise pytest.UsageError(f"{nodeid}: @pytest.mark.slow needs reason='why it is slow' and "
                                "budget_s=<seconds>, as keywords")
    if isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0:
        raise pytest.UsageError(f"{nodeid}: @pytest.mark.slow budget_s must be a positive number of "
                                f"seconds, got {budget!r}")
    return float(budget)


def budget_of(item: pytest.Item) -> float:
    """Seconds one test may take, setup and teardown included."""
    mark = item.get_closest_marker("slow")
    if mark is not None:
        return slow_budget(item.nodeid, mark)
    return float(item.config.getini("test_budget_s"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A malformed ``slow`` marker stops the run at collection, not after the slow test ran."""
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            slow_budget(item.nodeid, mark)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report: TestReport = outcome.get_result()
    spent = item.stash.setdefault(_SPENT, {})
    if report.failed:
        spent["failed"] = 0.0  # already failing: not failed again for the time it took
    spent[report.when] = report.duration
    if report.when != "teardown" or "failed" in spent:
        return
    total, budget = sum(spent.values()), budget_of(item)
    if total <= budget:
        return
    phases = ", ".join(f"{when} {secs:.1f} s" for when, secs in spent.items())
    whose = ("its slow marker's budget_s" if item.get_closest_marker("slow")
             else "the per-test budget (ini test_budget_s)")
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} took {total:.1f} s ({phases}), over {whose} of {budget:g} s. "
                       "Make it faster, or mark it @pytest.mark.slow(reason='why', budget_s=<seconds>) "
                       "so that a slow test is a conscious choice.")
