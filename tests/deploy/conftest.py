"""The deployment tier's shared CPU stack (tests/deploy/cpu_stack.py) and the order that uses it:
the compose smoke test's checks on the fresh stack first, then the chaos test's faults on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.cpu_stack import CpuStacks

# modules that share the stack, in the order they must use it (the others keep their place)
STACK_ORDER = ("test_compose_smoke.py", "test_chaos.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the smoke test before the chaos test wherever both were collected (a stable reorder)."""
    slots = [i for i, item in enumerate(items) if item.path.name in STACK_ORDER]
    ordered = sorted((items[i] for i in slots), key=lambda item: STACK_ORDER.index(item.path.name))
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def _cpu_stacks(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuStacks]:
    users = {item.nodeid for item in request.session.items
             if "cpu_stack" in getattr(item, "fixturenames", ())}
    stacks = CpuStacks(tmp_path_factory, users)
    try:
        yield stacks
    finally:
        stacks.close()  # nothing left to do when the last user already took them down


@pytest.fixture
def cpu_stack(_cpu_stacks: CpuStacks, request: pytest.FixtureRequest) -> Iterator[CpuStacks]:
    """The session's CPU stacks; the last test that uses one takes them all down (``down -v``)."""
    yield _cpu_stacks
    _cpu_stacks.done(request.node.nodeid)
