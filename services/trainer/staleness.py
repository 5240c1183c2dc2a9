"""Admission control and the staleness rule: how far rollout may run ahead of training.

Invariants:
- ``admitted`` counts the prompt jobs that are *accepted or in flight*: pushed and not yet
  resolved, or resolved into a group the trainer kept (trained on, or held for the next step).
  A group that is dropped (stale, filtered by dynamic sampling, malformed) gives its slot back
  through ``release``; a duplicate (a second copy of a job already resolved) changes nothing.
  As in AReaL's staleness manager, rejected work never holds admission room;
- at policy ``version`` at most ``(max_staleness + version + 1) * batch_prompts`` groups are
  accepted or in flight. Every step consumes exactly ``batch_prompts`` accepted groups and
  advances the version by one, so ``version * batch_prompts`` of them are trained on and
  ``admitted - version * batch_prompts`` (held + in flight) never exceeds
  ``(max_staleness + 1) * batch_prompts``;
- hence no deadlock: while the batch is short of ``batch_prompts`` and nothing is in flight,
  ``capacity() >= batch_prompts - held > 0``, so a prompt can be admitted whenever one remains;
  when none remains and nothing is in flight, the data is used up (``in_flight(held) == 0``);
- a group is stale, and must not be trained on, when its oldest generated token came from
  a policy more than ``max_staleness`` versions behind the trainer's;
- the state (``version``, ``admitted``) is part of every checkpoint: a resumed trainer
  neither re-admits nor forgets work, and neither loses nor gains slots (drops are
  acknowledged in Redis only with the checkpoint that contains their returned slot).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessManager:
    batch_prompts: int
    max_staleness: int
    version: int = 0
    admitted: int = 0

    @property
    def trained(self) -> int:
        """Groups consumed by the steps so far (each step uses exactly ``batch_prompts``)."""
        return self.version * self.batch_prompts

    def capacity(self) -> int:
        """Prompt jobs that may still be admitted at the current version."""
        return max((self.max_staleness + self.version + 1) * self.batch_prompts - self.admitted, 0)

    def admit(self, wanted: int) -> int:
        granted = min(max(wanted, 0), self.capacity())
        self.admitted += granted
        return granted

    def release(self, n: int = 1) -> int:
        """Give back the slots of ``n`` dropped groups; returns how many were given back.

        Never below the groups already trained on: a flood of junk messages (malformed groups
        that no admission produced) cannot open more room than the jobs actually admitted.
        """
        if n < 0:
            raise ValueError(f"release: n must be >= 0, got {n}")
        given = max(min(n, self.admitted - self.trained), 0)
        self.admitted -= given
        return given

    def in_flight(self, held: int) -> int:
        """Admitted jobs not resolved yet, when ``held`` accepted groups wait for the next step."""
        return self.admitted - self.trained - held

    def advance(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went back from {self.version} to {version}")
        self.version = version

    def staleness(self, group_version: int) -> int:
        return self.version - group_version

    def is_stale(self, group_version: int) -> bool:
        return self.staleness(group_version) > self.max_staleness

    def state_dict(self) -> dict[str, int]:
        return {"version": self.version, "admitted": self.admitted}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.version = int(state["version"])
        self.admitted = int(state["admitted"])
