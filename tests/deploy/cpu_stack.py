"""One CPU compose stack for the compose smoke test and the chaos test: one bring-up per session.

Both tests need the same thing to start from: the image, a ``small`` SFT'd model and its data, and
the CPU profile up with two rollout replicas. Bringing it up twice cost a model, a ``compose up``,
a wait for every container healthy and a ``compose down``; now the smoke test's checks run on it
first, then the chaos test's faults on the same stack (tests/deploy/conftest.py orders them).

The stack is the chaos test's (``chaos.Stack.prepare``): the project's compose file plus the
chaos override, whose additions lie idle until a fault uses them (the checkpoint hold file that
does not exist, quicker re-claims, a 2 s Prometheus scrape, the sandbox container at
``chaos.SANDBOX_MEM_LIMIT``, which is above what any smoke run may hold: a run's cgroup admits
576 MB). Grafana joins when its image exists, as it did for the smoke test alone.

Invariants:
- a stack whose run the chaos test finished (``finished``: its trainer stopped at its step limit)
  is never handed out again; whoever asks next gets a fresh one, so any order of the two tests,
  or either alone, still gets what it needs;
- ``trainer_restarts``: how often a test restarted the trainer on purpose (each restart is one
  more resume in the training ledger, which the chaos test counts);
- a test that fails on the stack marks it ``finished`` too: the next test does not inherit a
  broken stack;
- once the last test of the session that uses a stack is done (``done``), every stack is taken
  down with ``down -v`` (before the next deploy test starts its own), and that fails if a
  container or a volume of its project is left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from tests.deploy import chaos
from tests.deploy.engine import Phases, build_image, image_exists, require_engine, run

IMAGE = os.environ.get("RETOOL_SMOKE_IMAGE", "retool:cpu")
GRAFANA_IMAGE = "grafana/grafana:11.1.0"


@dataclass
class SharedStack:
    stack: chaos.Stack
    services: list[str]
    grafana: bool
    finished: bool = False
    trainer_restarts: int = 0


@dataclass
class CpuStacks:
    """Hands out the session's CPU stack (see the module's invariants)."""

    tmp_factory: pytest.TempPathFactory
    users: set[str]  # node ids of the session's tests that have yet to use a stack
    _current: SharedStack | None = None
    _all: list[SharedStack] = field(default_factory=list)

    def get(self, phases: Phases) -> SharedStack:
        """The live stack, or a fresh one (image, model and data, ``compose up``), timed in ``phases``."""
        require_engine()
        if self._current is not None and not self._current.finished:
            phases.done("shared stack (already up)")
            return self._current
        build_image(IMAGE)
        phases.done("build image")
        tmp = self.tmp_factory.mktemp("cpu-stack")
        tmp.chmod(0o755)
        s = chaos.Stack.prepare(tmp, IMAGE, f"retool-cpu-{os.getpid()}-{len(self._all)}")
        phases.done("model and data")
        grafana = image_exists(GRAFANA_IMAGE)
        services = chaos.SERVICES + (["grafana"] if grafana else [])
        shared = SharedStack(s, services, grafana)
        self._all.append(shared)
        self._current = shared
        # compose waits for each depends_on to be healthy before starting the next
        s.start(services)
        phases.done("compose up" + (" (with grafana)" if grafana else " (no grafana image)"))
        return shared

    def done(self, nodeid: str) -> None:
        """``nodeid`` is done with the stack; after the last user, every stack goes down (``close``)."""
        self.users.discard(nodeid)
        if not self.users:
            self.close()

    def close(self) -> None:
        """``down -v`` of every stack handed out; none may leave a container or a volume behind."""
        if not self._all:
            return
        phases = Phases()
        stacks, self._all, self._current = self._all, [], None
        left: dict[str, object] = {}
        for shared in stacks:
            c = shared.stack.c
            c.cmd("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)
            containers = c.containers()
            volumes = run(["docker", "volume", "ls", "-q", "--filter",
                           f"label=com.docker.compose.project={c.project}"], timeout=60).stdout.split()
            if containers or volumes:
                left[c.project] = {"containers": containers, "volumes": volumes}
        assert left == {}, f"compose down -v left these behind: {left}"
        phases.done(f"compose down -v ({len(stacks)} stack{'s' if len(stacks) > 1 else ''})")
