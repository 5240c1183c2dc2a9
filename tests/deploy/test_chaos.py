"""Chaos under a real Docker engine: every service killed mid-run, and nothing lost or trained twice.

The CPU profile (``deploy/docker-compose.yml``) with two rollout replicas trains while eight faults
hit it, one at a time, each where it hurts (``tests/deploy/chaos.py`` says how each is injected):

1. SIGKILL of a rollout replica while it holds a job with a turn checkpoint (restarted by its
   policy; the job's samples continue, counted, ``tests/deploy/chaos_inflight.py``);
2. SIGKILL of the sandbox with runs in flight;
3. SIGKILL of the reward service while rollouts are graded;
4. SIGKILL of the trainer while it writes a checkpoint (the half-written one is never resumed);
5. SIGKILL of Redis (AOF everysec): clients ride out the restart, vanished jobs are re-issued;
6. a rollout replica off the network for 30 s during weight pushes (skipped within
   ``weight_push_wait_s``, its jobs re-claimed, a full push once back);
7. the sandbox container at its memory limit;
8. SIGTERM of a rollout replica while it generates (a drain: exit 0, its jobs handed back and
   taken over, none re-claimed, no token regenerated).

Then the run is finished (its step limit set a few steps ahead, the trainer restarted to read
it) and checked: it reached its step count, the training ledger holds its invariant (every
admitted job trained once or dropped with a reason, never twice, none vanished), every replica is
at the trainer's version, and each fault showed in Prometheus (the target's ``up`` went to 0, or
the matching failure counter rose). Per fault it prints the time to recover and what was redone.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.deploy import chaos
from tests.deploy.engine import Phases
from tests.helpers.ledger_witness import check_nothing_unaccounted

pytestmark = pytest.mark.integration
FINAL_EXTRA_STEPS = 4


@pytest.mark.timeout(3600)
@pytest.mark.slow(reason="builds the image if no other deploy test did, then a compose stack "
                  "trained under eight faults", budget_s=3000)
def test_every_service_killed_mid_run_loses_nothing_and_trains_nothing_twice(cpu_stack):
    phases = Phases()
    # the image, model and data and the bring-up, shared with the compose smoke test (which runs
    # first on it, tests/deploy/cpu_stack.py); a fresh stack when the smoke test did not run
    shared = cpu_stack.get(phases)
    s = shared.stack
    results: list[chaos.FaultResult] = []
    try:
        s.settled()
        phases.done("3 steps, every replica at the trainer's version")
        restarted_before = shared.trainer_restarts  # by the smoke test: each one more resume

        for fault in chaos.FAULTS:
            r = chaos.inject(s, fault)
            results.append(r)
            phases.done(f"{r.fault}: recovered in {r.recover_s:.1f} s ({r.redone}; {r.visible}) {r.detail}")

        target, versions, report = s.finish(FINAL_EXTRA_STEPS)
        assert versions == [target] * chaos.REPLICAS, versions  # every replica at the trainer's version
        phases.done(f"run ended at step {target}; ledger {json.dumps(report.as_dict())}")
    except BaseException:
        print(s.diag())
        raise
    finally:
        shared.finished = True  # its run is over (or broken): never handed out again

    sys.__stderr__.write("\n" + chaos.table(results) + "\n")
    assert report.ok, report.violations  # nothing trained twice, nothing vanished silently
    assert report.steps == target and report.ended
    assert report.trained_groups == target * s.cfg["trainer"]["batch_prompts"]
    # Redis, counting on its own: no group acknowledged (gone) that the ledger does not account for
    check_nothing_unaccounted(s.ledger_file, s.groups_witness)
    # no fault but the trainer's own restarted the trainer (a replica's death once crashed it: the full
    # push to every replica was cancelled by the dead one's failure)
    assert {r.fault: r.trainer_restarts for r in results} == {
        r.fault: int(r.fault.startswith("trainer")) for r in results}
    # the fresh start, the kill in the checkpoint, the final restart, and each restart an earlier test
    # made on this stack (the smoke test's, which checks the resume itself)
    assert len(report.resumes) == 3 + restarted_before
    assert len(results) == len(chaos.FAULTS) == 8
    for r in results:  # each fault showed in Prometheus
        assert r.seen, r
