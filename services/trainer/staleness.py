"""Admission control and the staleness rule: how far rollout may run ahead of training.

Invariants:
- at most ``(max_staleness + version + 1) * batch_prompts`` prompt jobs are ever admitted
  while the trainer is at policy ``version``, so rollout never runs far ahead;
- a group is stale, and must not be trained on, when its oldest generated token came from
  a policy more than ``max_staleness`` versions behind the trainer's;
- the state (``version``, ``admitted``) is part of every checkpoint: a resumed trainer
  neither re-admits nor forgets work.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StalenessManager:
    batch_prompts: int
    max_staleness: int
    version: int = 0
    admitted: int = 0

    def capacity(self) -> int:
        """Prompt jobs that may still be admitted at the current version."""
        return max((self.max_staleness + self.version + 1) * self.batch_prompts - self.admitted, 0)

    def admit(self, wanted: int) -> int:
        granted = min(wanted, self.capacity())
        self.admitted += granted
        return granted

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

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
