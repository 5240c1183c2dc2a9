"""Wire schemas shared by the trainer and the rollout service: PromptJob, Trajectory, Group.

Invariants (checked when a model is built, so a bad message fails at the boundary):
- a trajectory's ``response_ids``, ``loss_mask``, ``logprobs`` and ``versions`` have the same
  length; ``loss_mask[i] == 0`` exactly where ``versions[i] == -1`` (interpreter/tool tokens, not
  the policy's actions), and those positions carry ``logprobs[i] == 0.0``;
- token ids are never re-tokenized: they travel as int32 arrays end to end.

Binary encoding (msgpack, used on the Redis streams): arrays travel as little-endian packed
bytes, never as JSON numbers. A PromptJob's prompt ids are ``int32`` (schema 1). A Group travels
as columns (``group_wire.py``, schema 2: ids at 2-4 bytes, log-probs ``float32`` for generated
tokens only, versions run-length encoded, the loss mask implied by the versions); log-probs
therefore round-trip at float32 precision. The JSON form (HTTP) uses plain lists.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

PROMPT_JOB_SCHEMA = 1  # PromptJob's msgpack form; a Group's is group_wire.GROUP_SCHEMA

TrajectoryFinish = Literal["eos", "answer", "max_turns", "length", "abort", "error"]


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(WireModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[dict[str, Any]] | None = None


class RolloutSampling(WireModel):
    """Sampling of one rollout request; ``max_tokens`` bounds the whole response (all turns)."""

    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, description="response token budget; default from config")
    seed: int | None = Field(None, description="sample i of a request uses seed + i")


class PromptJob(WireModel):
    """One prompt to roll out ``n`` times (trainer -> ``prompts`` stream). ``job_id`` is the dedupe key."""

    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1)
    messages: list[ChatMessage] | None = None
    prompt_ids: list[int] | None = Field(None, description="already chat-templated prompt token ids")
    ground_truth: str | None = None
    data_source: str | None = None
    n: int = Field(1, ge=1, le=1024)
    sampling: RolloutSampling = Field(default_factory=RolloutSampling)
    max_turns: int | None = Field(None, ge=0)
    policy_version: int = Field(-1, description="trainer's policy version when the job was admitted")
    meta: dict[str, Any] = Field(default_factory=dict, description="opaque, copied onto the Group")
    created_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _one_prompt(self) -> PromptJob:
        if (self.messages is None) == (self.prompt_ids is None):
            raise ValueError("exactly one of 'messages' or 'prompt_ids' must be given")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("'prompt_ids' must not be empty")
        return self

    def to_msgpack(self) -> bytes:
        data = self.model_dump(mode="json", exclude={"prompt_ids"})
        data["prompt_ids"] = pack_array(self.prompt_ids, np.int32) if self.prompt_ids is not None else None
        data["schema"] = PROMPT_JOB_SCHEMA
        return msgpack.packb(data, use_bin_type=True)

    @classmethod
    def from_msgpack(cls, raw: bytes) -> PromptJob:
        data = unpack_map(raw, "PromptJob")
        check_schema(data, "PromptJob", PROMPT_JOB_SCHEMA)
        if data.get("prompt_ids") is not None:
            data["prompt_ids"] = packed_array(data["prompt_ids"], np.int32).tolist()
        return cls.model_validate(data)


class TrajectoryMeta(WireModel):
    """A trajectory's fields other than its token arrays (shared by ``Trajectory`` and the wire's
    ``PackedTrajectory``)."""

    index: int = Field(0, ge=0, description="sample index within its group")
    turns: int = Field(0, ge=0, description="model generation segments")
    tool_calls: int = Field(0, ge=0, description="tool calls attempted (malformed ones included)")
    tool_errors: int = Field(0, ge=0, description="tool calls that ended in an error text")
    tool_call_errors: list[bool] = Field(
        default_factory=list, description="per tool call, in order: whether it ended in an error text")
    first_code_token: int | None = Field(
        None, ge=0, description="response tokens before the first tool call's opening tag (<code>)")
    finish_reason: TrajectoryFinish
    truncated: bool = False
    reward: float | None = None
    correct: bool | None = None
    extracted: str | None = None
    reward_reason: str | None = None
    response_text: str | None = None


TOKEN_ARRAYS = ("response_ids", "loss_mask", "logprobs", "versions")


class Trajectory(TrajectoryMeta):
    """One response: generated tokens interleaved with interpreter tokens (loss mask 0)."""

    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int] = Field(description="policy version per token; -1 for interpreter tokens")

    @model_validator(mode="after")
    def _aligned(self) -> Trajectory:
        check_arrays(
            len(self.response_ids),
            np.asarray(self.loss_mask, dtype=np.int64),
            np.asarray(self.logprobs, dtype=np.float64),
            np.asarray(self.versions, dtype=np.int64),
        )
        return self

    @property
    def num_generated(self) -> int:
        return int(sum(self.loss_mask))


class GroupMeta(WireModel):
    """A group's fields other than its prompt ids and trajectories (shared by ``Group`` and the
    wire's ``PackedGroup``)."""

    job_id: str = Field(min_length=1, description="dedupe key: at-least-once delivery may repeat a group")
    ground_truth: str | None = None
    data_source: str | None = None
    job_policy_version: int = -1
    min_version: int = Field(-1, description="oldest policy version among generated tokens (-1 if none)")
    max_version: int = Field(-1, description="newest policy version among generated tokens (-1 if none)")
    replica: str = ""
    meta: dict[str, Any] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)


class Group(GroupMeta):
    """The ``n`` scored trajectories of one PromptJob (rollout -> ``groups`` stream)."""

    prompt_ids: list[int]
    trajectories: list[Trajectory]

    @model_validator(mode="after")
    def _indices(self) -> Group:
        check_indices(self.trajectories)
        return self

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]

    def to_msgpack(self) -> bytes:
        """The current wire form (``group_wire.encode_group``)."""
        # lazy: a cycle: group_wire imports this module's Group
        from services.common.group_wire import encode_group

        return encode_group(self)

    @classmethod
    def from_msgpack(cls, raw: bytes) -> Group:
        """Decode and check any supported wire form (``group_wire.decode_group``), as lists."""
        # lazy: a cycle: see to_msgpack
        from services.common.group_wire import decode_group

        return decode_group(raw).to_group()


def check_indices(trajectories: list[Any]) -> None:
    idx = [t.index for t in trajectories]
    if idx != list(range(len(idx))):
        raise ValueError(f"trajectory indices must be 0..n-1 in order, got {idx}")


def version_range(trajectories: Sequence[Any]) -> tuple[int, int]:
    """(min, max) policy version over generated tokens; (-1, -1) when nothing was generated."""
    lo, hi = None, None
    for t in trajectories:
        versions = np.asarray(t.versions, dtype=np.int64)
        gen = versions[versions >= 0]
        if gen.size:
            lo = int(gen.min()) if lo is None else min(lo, int(gen.min()))
            hi = int(gen.max()) if hi is None else max(hi, int(gen.max()))
    return (-1 if lo is None else lo, -1 if hi is None else hi)


def pack_array(values: Any, dtype: Any) -> bytes:
    """``values`` as little-endian packed bytes of ``dtype``."""
    arr = np.asarray(values, dtype=dtype)
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def packed_array(raw: Any, dtype: Any, what: str = "array") -> np.ndarray:
    """A read-only little-endian view of packed bytes (no copy); ValueError naming ``what`` otherwise."""
    if not isinstance(raw, bytes | bytearray):
        raise ValueError(f"{what}: expected packed bytes, got {type(raw).__name__}")
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise ValueError(f"{what}: packed array length {len(raw)} is not a multiple of {itemsize}")
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))


def check_arrays(n: int, mask: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> None:
    if not (len(mask) == len(logprobs) == len(versions) == n):
        raise ValueError(
            f"response_ids ({n}), loss_mask ({len(mask)}), logprobs ({len(logprobs)}) "
            f"and versions ({len(versions)}) must have the same length"
        )
    if not n:
        return
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("loss_mask values must be 0 or 1")
    interp = versions == -1
    if not np.array_equal(interp, mask == 0):
        raise ValueError("loss_mask must be 0 exactly where versions == -1 (interpreter tokens)")
    if (logprobs[interp] != 0.0).any():
        raise ValueError("logprobs must be 0.0 for masked (interpreter) tokens")


def unpack_map(raw: bytes, what: str) -> dict[str, Any]:
    """A msgpack map; ValueError naming ``what`` for anything else."""
    try:
        data = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"{what}: not valid msgpack: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a msgpack map")
    return data


def check_schema(data: dict[str, Any], what: str, *supported: int) -> int:
    """Pop ``schema`` from a decoded map; ValueError naming the version unless it is ``supported``."""
    schema = data.pop("schema", None)
    if schema not in supported or isinstance(schema, bool):
        expected = " or ".join(str(v) for v in supported)
        raise ValueError(f"{what}: schema version {schema!r} is not supported (expected {expected})")
    return schema
