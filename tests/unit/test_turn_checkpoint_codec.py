"""Turn checkpoint segments: the wire's compact token encoding, round trip and refusals."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from services.rollout.agent.checkpoint import SampleCheckpoint, _load_sample, decode_segment, encode_segment


def _segment(n_gen: int, n_tool: int, first_id: int) -> tuple[list[int], list[int], list[float], list[int]]:
    ids = list(range(first_id, first_id + n_gen + n_tool))
    mask = [1] * n_gen + [0] * n_tool
    lps = [float(np.float32(-0.1 * (k + 1))) for k in range(n_gen)] + [0.0] * n_tool
    versions = [3] * (n_gen // 2) + [4] * (n_gen - n_gen // 2) + [-1] * n_tool
    return ids, mask, lps, versions


@pytest.mark.parametrize("first_id", [5, 70_000, 20_000_000])  # ids packed in 2, 3 and 4 bytes
def test_segment_round_trip_keeps_ids_mask_logprobs_versions_and_cells(first_id: int) -> None:
    ids, mask, lps, versions = _segment(40, 7, first_id)
    cells = [("x = 1\nprint(x)", "1"), ("print('é')", "é")]
    out = decode_segment(encode_segment(ids, mask, lps, versions, cells))
    assert out == (ids, mask, lps, versions, cells)


def test_segment_costs_the_wire_bytes_per_token() -> None:
    ids, mask, lps, versions = _segment(4000, 0, 100_000)  # a 152k vocabulary: 3-byte ids
    raw = encode_segment(ids, mask, lps, versions, [])
    assert len(raw) <= 4000 * (3 + 4) + 128  # ids + float32 log-probs + keys; versions: two runs


def test_logprobs_of_interpreter_tokens_must_be_zero() -> None:
    with pytest.raises(ValueError, match="logprobs must be 0.0 for masked"):
        encode_segment([1, 2], [1, 0], [-0.5, -0.5], [2, -1], [])


def test_damaged_segment_is_refused_naming_the_field() -> None:
    raw = encode_segment(*_segment(10, 2, 9), [])
    data = msgpack.unpackb(raw)
    data["logprobs"] = data["logprobs"][:-4]
    with pytest.raises(ValueError, match="checkpoint logprobs: 9 values for 10 generated tokens"):
        decode_segment(msgpack.packb(data))
    data = msgpack.unpackb(raw)
    data["cells"] = ["just code"]
    with pytest.raises(ValueError, match="checkpoint cells"):
        decode_segment(msgpack.packb(data))
    with pytest.raises(ValueError, match="checkpoint segment: not valid msgpack"):
        decode_segment(b"\xc1")


def test_oldest_version_ignores_interpreter_tokens() -> None:
    assert SampleCheckpoint(versions=[-1, 7, 5, -1, 6]).oldest_version() == 5
    assert SampleCheckpoint(versions=[-1]).oldest_version() is None


def _meta(**extra: object) -> bytes:
    return msgpack.packb({"segments": ["0:w:0"], "length": 12, "turns": 1, "tool_calls": 1, "tool_errors": 0,
                          "tool_call_errors": [False], "first_code_token": 3, "finish": None, **extra})


def test_meta_turn_start_absent_means_a_turn_boundary_and_is_checked() -> None:
    fields = {b"0:w:0": encode_segment(*_segment(10, 2, 9), [])}
    assert _load_sample(_meta(), fields).turn_start is None  # written before the field existed
    assert _load_sample(_meta(turn_start=None), fields).turn_start is None
    assert _load_sample(_meta(turn_start=4), fields).turn_start == 4  # mid-turn: the open turn's start
    with pytest.raises(ValueError, match="turn_start 13 is outside its 12 tokens"):
        _load_sample(_meta(turn_start=13), fields)
