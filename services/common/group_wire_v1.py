"""Group wire form, schema 1 (the format before ``group_wire``'s schema 2): kept to read groups that
replicas not yet upgraded still write, and as the benchmark's baseline (``bench/rollout_codec.py``).

Layout: a msgpack map of the Group's fields plus ``schema: 1``; ``prompt_ids`` and each
trajectory's ``response_ids``/``versions`` as little-endian ``int32`` bytes, ``loss_mask`` as
``uint8``, ``logprobs`` as ``float32``: 13 bytes per response token.

Invariant: ``decode_v1`` is what a schema-1 reader does: it refuses any other schema with a
ValueError naming the version (``tests/unit/test_group_wire.py`` shows a v1 reader meeting a v2
group), and checks the same alignment invariants as ``Trajectory``.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from services.common.schemas import (
    TOKEN_ARRAYS,
    Group,
    Trajectory,
    check_arrays,
    check_schema,
    pack_array,
    packed_array,
    unpack_map,
)

SCHEMA = 1
DTYPES = {"response_ids": np.int32, "loss_mask": np.uint8, "logprobs": np.float32, "versions": np.int32}


def encode_v1(group: Group) -> bytes:
    data = group.model_dump(exclude={"prompt_ids", "trajectories"})
    data["prompt_ids"] = pack_array(group.prompt_ids, np.int32)
    trajs = []
    for t in group.trajectories:
        tdata = t.model_dump(exclude=set(TOKEN_ARRAYS))
        tdata.update({name: pack_array(getattr(t, name), DTYPES[name]) for name in TOKEN_ARRAYS})
        trajs.append(tdata)
    data["trajectories"] = trajs
    data["schema"] = SCHEMA
    return msgpack.packb(data, use_bin_type=True)


def trajectory_arrays(tdata: dict[str, Any], where: str) -> dict[str, np.ndarray]:
    """Pop and check one schema-1 trajectory's four arrays (views of its bytes)."""
    arrays = {name: packed_array(tdata.pop(name, None), DTYPES[name], f"{where}.{name}")
              for name in TOKEN_ARRAYS}
    check_arrays(len(arrays["response_ids"]), arrays["loss_mask"], arrays["logprobs"], arrays["versions"])
    return arrays


def decode_v1(raw: bytes) -> Group:
    """A schema-1 reader: the Group, or a ValueError (other schema versions included)."""
    data = unpack_map(raw, "Group")
    check_schema(data, "Group", SCHEMA)
    data["prompt_ids"] = packed_array(data.get("prompt_ids"), np.int32, "prompt_ids").tolist()
    trajs = data.get("trajectories")
    if not isinstance(trajs, list) or not all(isinstance(t, dict) for t in trajs):
        raise ValueError("Group: trajectories must be a list of maps")
    data["trajectories"] = []
    for i, tdata in enumerate(trajs):
        arrays = trajectory_arrays(tdata, f"trajectories[{i}]")
        shell = Trajectory.model_validate({**tdata, **{name: [] for name in TOKEN_ARRAYS}})
        data["trajectories"].append(shell.model_copy(update={k: v.tolist() for k, v in arrays.items()}))
    return Group.model_validate(data)
