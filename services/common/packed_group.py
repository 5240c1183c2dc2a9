"""A scored group as the wire decoder hands it out: pydantic-validated metadata plus numpy columns.

The trainer's feed reads groups as ``PackedGroup``s: a 16 x 16k-token group is four arrays, not a
million Python objects. ``Group`` (lists) stays the model that producers build and HTTP carries;
``to_group()`` converts when a caller needs lists.

Invariants (``group_wire.decode_group`` builds these only after every check passed):
- the metadata fields are exactly ``GroupMeta``/``TrajectoryMeta``'s, validated by pydantic;
- a trajectory's ``response_ids`` (int32, >= 0), ``loss_mask`` (uint8), ``logprobs`` (float32,
  finite) and ``versions`` (int32, >= -1) are read-only numpy arrays of the same length, views
  into one buffer per group; ``loss_mask`` is 1 exactly where ``versions != -1`` and ``logprobs``
  is 0.0 where the mask is 0, like ``Trajectory``;
- ``to_group()`` equals the ``Group`` that was encoded (log-probs at float32 precision).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import PrivateAttr, model_validator

from services.common.schemas import (
    TOKEN_ARRAYS,
    Group,
    GroupMeta,
    Trajectory,
    TrajectoryMeta,
    check_indices,
)


class PackedTrajectory(TrajectoryMeta):
    """``Trajectory``'s fields, with the token arrays as read-only numpy views."""

    _arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] = PrivateAttr()

    def attach(self, ids: np.ndarray, mask: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> None:
        """Set the (already checked) token arrays; called by the decoder only."""
        for a in (ids, mask, logprobs, versions):
            a.flags.writeable = False
        self._arrays = (ids, mask, logprobs, versions)

    @property
    def response_ids(self) -> np.ndarray:
        return self._arrays[0]

    @property
    def loss_mask(self) -> np.ndarray:
        return self._arrays[1]

    @property
    def logprobs(self) -> np.ndarray:
        return self._arrays[2]

    @property
    def versions(self) -> np.ndarray:
        return self._arrays[3]

    @property
    def num_generated(self) -> int:
        return int(np.count_nonzero(self._arrays[1]))

    def to_trajectory(self) -> Trajectory:
        arrays = {name: a.tolist() for name, a in zip(TOKEN_ARRAYS, self._arrays, strict=True)}
        return Trajectory.model_construct(self.model_fields_set | set(TOKEN_ARRAYS), **dict(self), **arrays)


class PackedGroup(GroupMeta):
    """``Group``'s fields, with the prompt ids and each trajectory's tokens as numpy arrays."""

    trajectories: list[PackedTrajectory]
    _prompt_ids: np.ndarray = PrivateAttr()

    @model_validator(mode="after")
    def _indices(self) -> PackedGroup:
        check_indices(self.trajectories)
        return self

    def attach(self, prompt_ids: np.ndarray) -> None:
        prompt_ids.flags.writeable = False
        self._prompt_ids = prompt_ids

    @property
    def prompt_ids(self) -> np.ndarray:
        return self._prompt_ids

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]

    @property
    def num_tokens(self) -> int:
        """Response tokens over all trajectories."""
        return sum(len(t.response_ids) for t in self.trajectories)

    def to_group(self) -> Group:
        fields: dict[str, Any] = dict(self)
        fields["trajectories"] = [t.to_trajectory() for t in self.trajectories]
        fields["prompt_ids"] = self._prompt_ids.tolist()
        return Group.model_construct(self.model_fields_set | {"prompt_ids"}, **fields)
