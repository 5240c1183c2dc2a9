"""A scored Group on the Redis stream: schema 2, columnar and packed; decoded and checked in numpy.

Layout (one msgpack map): the ``GroupMeta`` fields, ``schema: 2``, ``trajectories`` (a list of
``TrajectoryMeta`` maps, no token arrays), ``prompt_ids`` (packed ids) and ``tokens``, the token
columns of all trajectories concatenated in index order:
- ``lengths``: uint32 per trajectory (its response tokens);
- ``ids``: packed ids, ``{"width": w, "data": bytes}``: little-endian unsigned integers of
  ``w`` = 2, 3 or 4 bytes, the smallest that holds the largest id (a 152k vocabulary takes 3);
- ``runs`` (uint32 per trajectory), ``run_versions`` (int32), ``run_lengths`` (uint32): the
  per-token versions, run-length encoded within each trajectory (a response's versions change
  only at a weight swap or a tool turn, so a trajectory is a few runs);
- ``logprobs``: float32, for the generated tokens only (those whose version is not -1).
The loss mask does not travel: it is 1 exactly where the version is not -1 (``Trajectory``'s
invariant, checked again by the encoder), and interpreter tokens' log-probs are 0.0 by the same
invariant. About 3 + 4 x (generated fraction) bytes per token, against 13 for schema 1.

Invariants:
- ``decode_group`` returns a ``PackedGroup`` only when every check passed, else a ValueError
  naming the field: metadata by pydantic; arrays vectorised in numpy (lengths agree, runs cover
  exactly each trajectory, versions >= -1, ids >= 0 and < ``vocab_size`` when given, log-probs
  finite, one log-prob per generated token). No per-token Python: columns are views or one-pass
  numpy transforms of the received bytes.
- It reads schema 1 too (``group_wire_v1``, replicas not upgraded yet), with the same checks;
  any other schema is a ValueError naming it. A schema-1 reader refuses schema 2 the same way.
- ``decode_group(encode_group(g)).to_group() == g`` with log-probs rounded to float32.
- Per-token versions are not required to be non-decreasing: a trainer resumed from an older
  checkpoint pushes a lower version than a replica had (see ``docs/design.md``).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import msgpack
import numpy as np
from pydantic import StrictBytes

from services.common import group_wire_v1
from services.common.packed_group import PackedGroup
from services.common.schemas import (
    Group,
    GroupMeta,
    TrajectoryMeta,
    WireModel,
    check_schema,
    pack_array,
    packed_array,
    unpack_map,
)

GROUP_SCHEMA = 2
MAX_ID = 2**31 - 1
_META = set(GroupMeta.model_fields)
_TRAJ_META = set(TrajectoryMeta.model_fields)


class PackedIds(WireModel):
    width: Literal[2, 3, 4]
    data: StrictBytes


class TokenColumns(WireModel):
    lengths: StrictBytes
    ids: PackedIds
    runs: StrictBytes
    run_versions: StrictBytes
    run_lengths: StrictBytes
    logprobs: StrictBytes


class Columns(NamedTuple):
    """One group's decoded token columns, all trajectories concatenated."""

    prompt: np.ndarray  # int32
    lengths: np.ndarray  # per trajectory
    ids: np.ndarray  # int32
    mask: np.ndarray  # uint8
    logprobs: np.ndarray  # float32
    versions: np.ndarray  # int32


# ---- encode -----------------------------------------------------------------------------------
def encode_group(group: Group | PackedGroup) -> bytes:
    """Schema 2 bytes of a Group (lists) or a PackedGroup; ValueError if an invariant is broken."""
    ids_parts, ver_parts, lp_parts = [], [], []
    for i, t in enumerate(group.trajectories):
        ids, versions, logprobs = trajectory_columns(t, f"trajectories[{i}]")
        ids_parts.append(ids)
        ver_parts.append(versions)
        lp_parts.append(logprobs)
    lengths = np.array([len(p) for p in ids_parts], dtype=np.int64)
    ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int64)
    versions = np.concatenate(ver_parts) if ver_parts else np.zeros(0, np.int64)
    run_versions, run_lengths, runs = version_runs(versions, lengths)
    data: dict[str, Any] = group.model_dump(include=_META)
    data["schema"] = GROUP_SCHEMA
    data["trajectories"] = [t.model_dump(include=_TRAJ_META) for t in group.trajectories]
    data["prompt_ids"] = pack_ids(np.asarray(group.prompt_ids, dtype=np.int64), "prompt_ids")
    data["tokens"] = {
        "lengths": pack_array(lengths, np.uint32),
        "ids": pack_ids(ids, "response_ids"),
        "runs": pack_array(runs, np.uint32),
        "run_versions": pack_array(run_versions, np.int32),
        "run_lengths": pack_array(run_lengths, np.uint32),
        "logprobs": np.concatenate(lp_parts).astype("<f4", copy=False).tobytes() if lp_parts else b"",
    }
    return msgpack.packb(data, use_bin_type=True)


def trajectory_columns(t: Any, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids int64, versions int64, log-probs float32 of the generated tokens) of one trajectory."""
    ids = np.asarray(t.response_ids, dtype=np.int64)
    versions = np.asarray(t.versions, dtype=np.int64)
    logprobs = np.asarray(t.logprobs, dtype=np.float32)
    mask = np.asarray(t.loss_mask)
    if not (len(versions) == len(logprobs) == len(mask) == len(ids)):
        raise ValueError(f"{where}: response_ids, loss_mask, logprobs and versions must have the same length")
    generated = versions != -1
    if not np.array_equal(generated, mask != 0):  # the mask travels implied by the versions
        raise ValueError(f"{where}: loss_mask must be 1 exactly where versions != -1")
    if (logprobs[~generated] != 0.0).any():  # these do not travel
        raise ValueError(f"{where}: logprobs must be 0.0 for masked (interpreter) tokens")
    return ids, versions, logprobs[generated]


def version_runs(versions: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of equal versions, never crossing a trajectory boundary: (values, lengths, runs per
    trajectory)."""
    if versions.size and (versions.min() < -1 or versions.max() > MAX_ID):
        raise ValueError(f"versions must be in [-1, {MAX_ID}]")
    n = len(versions)
    offsets = np.cumsum(lengths) - lengths
    start = np.ones(n, dtype=bool)
    start[1:] = versions[1:] != versions[:-1]
    start[offsets[lengths > 0]] = True
    starts = np.flatnonzero(start)
    runs = np.searchsorted(starts, offsets + lengths) - np.searchsorted(starts, offsets)
    return versions[starts], np.diff(np.append(starts, n)), runs


def pack_ids(ids: np.ndarray, what: str) -> dict[str, Any]:
    hi = int(ids.max()) if ids.size else 0
    if ids.size and (int(ids.min()) < 0 or hi > MAX_ID):
        raise ValueError(f"{what}: token ids must be in [0, {MAX_ID}]")
    if hi < 2**16:
        return {"width": 2, "data": ids.astype("<u2").tobytes()}
    if hi < 2**24:
        return {"width": 3, "data": ids.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()}
    return {"width": 4, "data": ids.astype("<u4").tobytes()}


# ---- decode -----------------------------------------------------------------------------------
def decode_group(raw: bytes, *, vocab_size: int | None = None) -> PackedGroup:
    """The checked PackedGroup of schema 2 (or 1) bytes; ValueError naming the problem otherwise."""
    data = unpack_map(raw, "Group")
    schema = check_schema(data, "Group", GROUP_SCHEMA, group_wire_v1.SCHEMA)
    if schema == GROUP_SCHEMA:
        prompt = data.pop("prompt_ids", None)
        tokens = data.pop("tokens", None)
        group = PackedGroup.model_validate(data)
        cols = _columns_v2(PackedIds.model_validate(prompt), TokenColumns.model_validate(tokens),
                           len(group.trajectories))
    else:
        cols = _columns_v1(data)
        group = PackedGroup.model_validate(data)
    _check_ids(cols.ids, vocab_size, "response_ids")
    _check_ids(cols.prompt, vocab_size, "prompt_ids")
    group.attach(cols.prompt)
    ends = np.cumsum(cols.lengths).tolist()
    start = 0
    for t, end in zip(group.trajectories, ends, strict=True):
        span = slice(start, end)
        t.attach(cols.ids[span], cols.mask[span], cols.logprobs[span], cols.versions[span])
        start = end
    return group


def _columns_v2(prompt: PackedIds, tokens: TokenColumns, n_traj: int) -> Columns:
    lengths = packed_array(tokens.lengths, np.uint32, "tokens.lengths")
    if len(lengths) != n_traj:
        raise ValueError(f"tokens.lengths: {len(lengths)} entries for {n_traj} trajectories")
    total = int(lengths.sum(dtype=np.int64))
    ids = unpack_ids(tokens.ids, "tokens.ids", total)
    runs = packed_array(tokens.runs, np.uint32, "tokens.runs")
    run_versions = packed_array(tokens.run_versions, np.int32, "tokens.run_versions")
    run_lengths = packed_array(tokens.run_lengths, np.uint32, "tokens.run_lengths")
    if len(runs) != n_traj:
        raise ValueError(f"tokens.runs: {len(runs)} entries for {n_traj} trajectories")
    n_runs = int(runs.sum(dtype=np.int64))
    if not len(run_versions) == len(run_lengths) == n_runs:
        raise ValueError(f"tokens.run_versions ({len(run_versions)}) and tokens.run_lengths "
                         f"({len(run_lengths)}) must both hold the {n_runs} runs that tokens.runs counts")
    if n_runs and int(run_lengths.min()) == 0:
        raise ValueError("tokens.run_lengths: every run covers at least one token")
    if n_runs and int(run_versions.min()) < -1:
        raise ValueError("tokens.run_versions: versions must be >= -1")
    run_tokens = np.concatenate(([0], np.cumsum(run_lengths, dtype=np.int64)))
    covered = np.diff(run_tokens[np.cumsum(runs, dtype=np.int64)], prepend=0)
    if not np.array_equal(covered, lengths):
        bad = int(np.flatnonzero(covered != lengths)[0])
        raise ValueError(f"tokens.run_lengths: the version runs of trajectory {bad} cover "
                         f"{int(covered[bad])} tokens, its length is {int(lengths[bad])}")
    versions = np.repeat(run_versions, run_lengths)
    generated = versions != -1
    compact = packed_array(tokens.logprobs, np.float32, "tokens.logprobs")
    n_generated = int(run_lengths[run_versions != -1].sum(dtype=np.int64))
    if len(compact) != n_generated:
        raise ValueError(f"tokens.logprobs: {len(compact)} values for {n_generated} generated tokens")
    _check_finite(compact, "tokens.logprobs")
    logprobs = np.zeros(total, dtype=np.float32)
    logprobs[generated] = compact
    prompt_ids = unpack_ids(prompt, "prompt_ids")
    return Columns(prompt_ids, lengths, ids, generated.view(np.uint8), logprobs, versions)


def _columns_v1(data: dict[str, Any]) -> Columns:
    """Schema-1 arrays, checked and concatenated; pops them from ``data`` (metadata stays)."""
    prompt = packed_array(data.pop("prompt_ids", None), np.int32, "prompt_ids")
    trajs = data.get("trajectories")
    if not isinstance(trajs, list) or not all(isinstance(t, dict) for t in trajs):
        raise ValueError("Group: trajectories must be a list of maps")
    parts = [group_wire_v1.trajectory_arrays(t, f"trajectories[{i}]") for i, t in enumerate(trajs)]

    def cat(name: str, dtype: Any) -> np.ndarray:
        return np.concatenate([p[name] for p in parts]).astype(dtype) if parts else np.zeros(0, dtype)

    logprobs = cat("logprobs", np.float32)
    _check_finite(logprobs, "logprobs")
    lengths = np.array([len(p["response_ids"]) for p in parts], dtype=np.int64)
    ids, mask, versions = cat("response_ids", np.int32), cat("loss_mask", np.uint8), cat("versions", np.int32)
    return Columns(prompt.astype(np.int32), lengths, ids, mask, logprobs, versions)


def unpack_ids(packed: PackedIds, what: str, count: int | None = None) -> np.ndarray:
    raw, width = packed.data, packed.width
    if len(raw) % width:
        raise ValueError(f"{what}: {len(raw)} bytes is not a multiple of the id width {width}")
    n = len(raw) // width
    if count is not None and n != count:
        raise ValueError(f"{what}: {n} ids for {count} tokens")
    if width == 2:
        return np.frombuffer(raw, dtype="<u2").astype(np.int32)
    if width == 4:
        return np.frombuffer(raw, dtype="<i4")  # negatives are refused by _check_ids
    out = np.empty(n, dtype=np.int32)  # width 3: read each id as 4 bytes at a 3-byte stride, mask the 4th
    if n > 1:
        out[: n - 1] = np.ndarray((n - 1,), dtype="<u4", buffer=raw, strides=(3,))
    if n:
        out[n - 1] = int.from_bytes(raw[-3:], "little")
    out &= 0xFFFFFF
    return out


def _check_ids(ids: np.ndarray, vocab_size: int | None, what: str) -> None:
    if not ids.size:
        return
    if int(ids.min()) < 0:
        raise ValueError(f"{what}: token ids must be >= 0")
    if vocab_size is not None and (hi := int(ids.max())) >= vocab_size:
        raise ValueError(f"{what}: token id {hi} is outside the vocabulary (vocab_size {vocab_size})")


def _check_finite(logprobs: np.ndarray, what: str) -> None:
    if not np.isfinite(logprobs).all():
        bad = int(np.flatnonzero(~np.isfinite(logprobs))[0])
        raise ValueError(f"{what}: log-prob {float(logprobs[bad])} at position {bad} is not finite")
