"""The Group wire codec (schema 2): exact round trips, compact columns, every check can refuse, and
the contract is versioned both ways (schema 1 still read; a schema-1 reader refuses schema 2)."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from services.common.group_wire import GROUP_SCHEMA, decode_group, encode_group
from services.common.group_wire_v1 import decode_v1, encode_v1
from services.common.packed_group import PackedGroup
from services.common.schemas import Group, Trajectory


def _trajectory(index: int, spans: list[tuple[int, int]], vocab: int, rng: random.Random) -> Trajectory:
    """``spans``: (version, tokens) in order; version -1 is an interpreter block."""
    ids, mask, lps, vers = [], [], [], []
    for version, count in spans:
        for _ in range(count):
            ids.append(rng.randrange(vocab))
            mask.append(int(version != -1))
            lps.append(0.0 if version == -1 else -rng.random() * 8)
            vers.append(version)
    return Trajectory(index=index, response_ids=ids, loss_mask=mask, logprobs=lps, versions=vers,
                      turns=2, tool_calls=1, tool_call_errors=[False], first_code_token=3,
                      finish_reason="answer", reward=float(index % 2), correct=bool(index % 2), extracted="7")


def _group(vocab: int = 152_000, seed: int = 0, spans: list[list[tuple[int, int]]] | None = None) -> Group:
    rng = random.Random(seed)
    spans = spans or [[(4, 30), (-1, 12), (5, 20)], [(5, 7)], [], [(4, 1), (-1, 3)]]
    return Group(job_id="job-1", prompt_ids=[rng.randrange(vocab) for _ in range(25)],
                 trajectories=[_trajectory(i, s, vocab, rng) for i, s in enumerate(spans)],
                 ground_truth="7", data_source="math", job_policy_version=4, min_version=4, max_version=5,
                 replica="r0", meta={"uid": "u"})


def _float32(group: Group) -> Group:
    """``group`` as the wire carries it: log-probs rounded to float32."""
    trajs = [t.model_copy(update={"logprobs": np.asarray(t.logprobs, np.float32).tolist()})
             for t in group.trajectories]
    return group.model_copy(update={"trajectories": trajs})


def _tampered(group: Group, edit) -> bytes:  # noqa: ANN001
    data = msgpack.unpackb(encode_group(group), raw=False)
    edit(data)
    return msgpack.packb(data, use_bin_type=True)


@pytest.mark.parametrize("vocab", [500, 152_000, 2**30])
def test_round_trip_is_exact_at_float32(vocab: int) -> None:
    group = _group(vocab)
    assert Group.from_msgpack(group.to_msgpack()) == _float32(group)
    packed = decode_group(group.to_msgpack())
    assert packed.model_dump() == group.model_dump(exclude={"prompt_ids", "trajectories"}) | {
        "trajectories": [t.model_dump(exclude={"response_ids", "loss_mask", "logprobs", "versions"})
                         for t in group.trajectories]}
    for t, p in zip(group.trajectories, packed.trajectories, strict=True):
        assert p.response_ids.dtype == np.int32 and p.response_ids.tolist() == t.response_ids
        assert p.loss_mask.dtype == np.uint8 and p.loss_mask.tolist() == t.loss_mask
        assert p.versions.dtype == np.int32 and p.versions.tolist() == t.versions
        assert p.logprobs.dtype == np.float32 and p.num_generated == t.num_generated
        assert not p.response_ids.flags.writeable and not p.logprobs.flags.writeable
    assert packed.prompt_ids.tolist() == group.prompt_ids
    # a packed group encodes to the same bytes as the list form
    assert encode_group(packed) == encode_group(group)


@pytest.mark.parametrize(("vocab", "width"),
                         [(500, 2), (2**16, 2), (2**16 + 1, 3), (152_000, 3), (2**24 + 1, 4)])
def test_ids_take_the_smallest_width_that_holds_them(vocab: int, width: int) -> None:
    top = [(3, 5)]
    group = _group(vocab=min(vocab, 500), spans=[top, top])
    group.trajectories[0].response_ids[0] = vocab - 1  # the largest id present decides
    data = msgpack.unpackb(group.to_msgpack(), raw=False)
    assert data["schema"] == GROUP_SCHEMA and data["tokens"]["ids"]["width"] == width
    assert len(data["tokens"]["ids"]["data"]) == width * 10
    assert decode_group(group.to_msgpack()).trajectories[0].response_ids[0] == vocab - 1


def test_versions_travel_as_runs_within_each_trajectory_and_the_mask_not_at_all() -> None:
    group = _group(spans=[[(4, 30), (-1, 12), (5, 20)], [(5, 7)], [], [(5, 1), (-1, 3)]])
    tokens = msgpack.unpackb(group.to_msgpack(), raw=False)["tokens"]
    assert np.frombuffer(tokens["runs"], "<u4").tolist() == [3, 1, 0, 2]  # a run never spans two
    assert np.frombuffer(tokens["run_versions"], "<i4").tolist() == [4, -1, 5, 5, 5, -1]
    assert np.frombuffer(tokens["run_lengths"], "<u4").tolist() == [30, 12, 20, 7, 1, 3]
    assert len(tokens["logprobs"]) == 4 * (30 + 20 + 7 + 1)  # generated tokens only
    assert "loss_mask" not in tokens


def test_long_responses_take_under_7_bytes_per_token() -> None:
    """3-byte ids (152k vocabulary) + float32 log-probs on the 3/4 that the policy generated."""
    turn = [(12, 1536), (-1, 512)]
    group = _group(spans=[turn * 4] * 4)
    tokens = 4 * 4 * 2048
    assert len(group.to_msgpack()) / tokens < 6.1
    assert len(encode_v1(group)) / tokens > 13  # schema 1: 13 bytes per token and a header


def test_schema_1_groups_are_still_read() -> None:
    group = _group()
    raw = encode_v1(group)
    assert msgpack.unpackb(raw, raw=False)["schema"] == 1
    assert decode_group(raw).to_group() == _float32(group)
    assert Group.from_msgpack(raw) == _float32(group)
    assert encode_group(decode_group(raw)) == encode_group(group)


def test_a_schema_1_reader_refuses_schema_2_naming_the_version() -> None:
    group = _group()
    with pytest.raises(ValueError, match=r"Group: schema version 2 is not supported \(expected 1\)"):
        decode_v1(group.to_msgpack())
    assert decode_v1(encode_v1(group)) == _float32(group)


@pytest.mark.parametrize("schema", [3, 0, None, "2", True])
def test_unknown_schemas_are_refused_naming_the_version(schema: object) -> None:
    def edit(data: dict) -> None:
        data["schema"] = schema

    with pytest.raises(ValueError, match=rf"schema version {schema!r} is not supported \(expected 2 or 1\)"):
        decode_group(_tampered(_group(), edit))


def _set(path: str, value: object):  # noqa: ANN202
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[key]
        data[last] = value(data[last]) if callable(value) else value

    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (_set("tokens.ids.data", lambda b: b[:-3]), "tokens.ids: 72 ids for 73 tokens"),
    (_set("tokens.ids.data", lambda b: b[:-1]), "not a multiple of the id width 3"),
    (_set("tokens.ids.width", 5), "width"),
    (_set("tokens.lengths", lambda b: b[:-4]), "tokens.lengths: 3 entries for 4 trajectories"),
    (_set("tokens.runs", np.array([3, 1, 0, 3], "<u4").tobytes()), "must both hold the 7 runs"),
    (_set("tokens.run_lengths", np.array([30, 12, 19, 7, 1, 3], "<u4").tobytes()),
     "the version runs of trajectory 0 cover 61 tokens, its length is 62"),
    (_set("tokens.run_lengths", np.array([30, 12, 20, 7, 0, 4], "<u4").tobytes()), "at least one token"),
    (_set("tokens.run_versions", np.array([4, -2, 5, 5, 4, -1], "<i4").tobytes()), "versions must be >= -1"),
    (_set("tokens.run_versions", np.array([4, 5, 5, 5, 4, -1], "<i4").tobytes()),
     "tokens.logprobs: 58 values for 70 generated tokens"),
    (_set("tokens.logprobs", lambda b: b[:4] + np.array([np.nan], "<f4").tobytes() + b[8:]),
     "tokens.logprobs: log-prob nan at position 1 is not finite"),
    (_set("tokens.logprobs", lambda b: b[:-4] + np.array([-np.inf], "<f4").tobytes()), "not finite"),
    (_set("tokens.run_lengths", [30, 12, 20, 7, 1, 3]), "run_lengths"),
    (_set("tokens", None), "TokenColumns"),
    (_set("prompt_ids", b"\x00\x01"), "PackedIds"),
    (_set("trajectories", lambda ts: ts[:3]), "tokens.lengths: 4 entries for 3 trajectories"),
    (_set("trajectories", lambda ts: [ts[1], ts[0], *ts[2:]]), "indices must be 0..n-1"),
    (_set("trajectories", lambda ts: [{**ts[0], "finish_reason": "exploded"}, *ts[1:]]), "finish_reason"),
    (_set("job_id", ""), "job_id"),
])
def test_each_check_refuses_a_broken_group_naming_the_field(edit, message: str) -> None:  # noqa: ANN001
    group = _group(spans=[[(4, 30), (-1, 12), (5, 20)], [(5, 7)], [], [(4, 1), (-1, 3)]])
    with pytest.raises(ValueError, match=message):
        decode_group(_tampered(group, edit))


def test_ids_outside_the_vocabulary_are_refused_when_it_is_known() -> None:
    raw = _group(vocab=1000).model_copy(update={"prompt_ids": [1, 2]}).to_msgpack()
    hi = int(max(decode_group(raw).trajectories[0].response_ids))
    assert decode_group(raw, vocab_size=hi + 1)
    with pytest.raises(ValueError, match=rf"response_ids: token id {hi} is outside the vocabulary"):
        decode_group(raw, vocab_size=hi)
    prompt_only = _group(vocab=10, spans=[[(1, 2)]])
    with pytest.raises(ValueError, match="prompt_ids: token id"):
        decode_group(prompt_only.to_msgpack(), vocab_size=int(max(prompt_only.prompt_ids)))


def test_schema_1_checks_still_apply() -> None:
    data = msgpack.unpackb(encode_v1(_group()), raw=False)
    data["trajectories"][0]["versions"] = np.zeros(62, dtype="<i4").tobytes()  # no -1 at the tool tokens
    with pytest.raises(ValueError, match="versions == -1"):
        decode_group(msgpack.packb(data, use_bin_type=True))
    data = msgpack.unpackb(encode_v1(_group()), raw=False)
    data["trajectories"][1]["logprobs"] = np.full(7, np.inf, dtype="<f4").tobytes()
    with pytest.raises(ValueError, match="logprobs: log-prob inf at position 62 is not finite"):
        decode_group(msgpack.packb(data, use_bin_type=True))
    data = msgpack.unpackb(encode_v1(_group()), raw=False)
    data["trajectories"][0]["logprobs"] = data["trajectories"][0]["logprobs"][:-4]
    with pytest.raises(ValueError, match="same length"):
        decode_group(msgpack.packb(data, use_bin_type=True))


def test_the_encoder_refuses_what_it_could_not_carry() -> None:
    t = _group().trajectories[0]
    mask = t.loss_mask.copy()
    mask[0] = 0  # a generated token with loss mask 0: the mask would not survive the trip
    broken = Trajectory.model_construct(**{**dict(t), "loss_mask": mask})
    with pytest.raises(ValueError, match="loss_mask must be 1 exactly where versions != -1"):
        encode_group(Group.model_construct(**{**dict(_group()), "trajectories": [broken]}))
    negative = Trajectory.model_construct(**{**dict(t), "response_ids": [-1] + t.response_ids[1:]})
    with pytest.raises(ValueError, match="token ids must be in"):
        encode_group(Group.model_construct(**{**dict(_group()), "trajectories": [negative]}))


def test_damaged_bytes_give_a_value_error_or_a_checked_group_never_a_crash() -> None:
    raw = _group().to_msgpack()
    rng = random.Random(7)
    outcomes = {"refused": 0, "decoded": 0}
    for _ in range(400):
        damaged = bytearray(raw)
        if rng.random() < 0.3:
            damaged = damaged[: rng.randrange(len(damaged))]
        for _ in range(rng.randint(1, 4)):
            if damaged:
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        try:
            group = decode_group(bytes(damaged))
        except ValueError:
            outcomes["refused"] += 1
            continue
        assert isinstance(group, PackedGroup)
        for t in group.trajectories:
            assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
            assert np.array_equal(t.loss_mask == 1, t.versions != -1)
            assert np.isfinite(t.logprobs).all()
        outcomes["decoded"] += 1
    assert outcomes["refused"] > 100 and outcomes["decoded"] > 10, outcomes
