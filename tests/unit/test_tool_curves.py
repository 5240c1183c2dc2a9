"""The ReTool curves of trajectories (services/common/tool_curves.py) and the trainer's test-only
broken multi-turn layouts (services/trainer/fault_mask.py)."""

from __future__ import annotations

import pytest

from services.common.schemas import Group, Trajectory
from services.common.tool_curves import tool_curves
from services.trainer import fault_mask


def _traj(errors: list[bool], correct: bool, n: int = 10, first: int | None = 3) -> Trajectory:
    return Trajectory(response_ids=list(range(n)), loss_mask=[1] * n, logprobs=[-0.1] * n, versions=[0] * n,
                      tool_calls=len(errors), tool_errors=sum(errors), tool_call_errors=errors,
                      first_code_token=first if errors else None, finish_reason="answer", correct=correct)


def test_curves_condition_on_the_first_call() -> None:
    trajs = [
        _traj([True, False], True, n=20, first=0),   # raised, fixed, right
        _traj([True], False, n=12, first=2),         # raised, guessed
        _traj([False], True, n=8, first=4),          # right first time
        _traj([], False, n=4),                       # direct answer
    ]
    c = tool_curves(trajs)
    assert c["accuracy"] == 0.5
    assert c["recovery_rate"] == 0.5          # 1 of the 2 whose first call raised
    assert c["first_call_success_rate"] == pytest.approx(1 / 3)
    assert c["code_calls_mean"] == 1.0
    assert c["first_code_token_mean"] == 2.0  # over responses with a call
    assert c["response_length_mean"] == 11.0
    assert (c["first_call_errors"], c["multi_call_responses"]) == (2.0, 1.0)


def test_rates_over_nothing_are_none_not_zero() -> None:
    c = tool_curves([_traj([], True)])
    assert c["recovery_rate"] is c["first_call_success_rate"] is c["first_code_token_mean"] is None
    assert tool_curves([_traj([False], True)])["recovery_rate"] is None
    with pytest.raises(ValueError):
        tool_curves([])


def test_trajectory_wire_round_trip_keeps_the_per_call_fields() -> None:
    group = Group(job_id="j", prompt_ids=[1, 2], trajectories=[_traj([True, False], True)])
    back = Group.from_msgpack(group.to_msgpack()).trajectories[0]
    assert (back.tool_call_errors, back.first_code_token) == ([True, False], 3)


# response: turn 1 (3 tokens), interpreter (2), turn 2 (2), interpreter (2), turn 3 (1)
IDS = [1, 2, 3, 90, 91, 4, 5, 92, 93, 6]
MASK = [1, 1, 1, 0, 0, 1, 1, 0, 0, 1]
LPS = [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5, 0.0, 0.0, -0.6]


def test_no_fault_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fault_mask.FAULT_MULTITURN_MASK, raising=False)
    assert fault_mask.mode() is None
    assert fault_mask.break_layout(IDS, MASK, LPS, None) == (IDS, MASK, LPS)


def test_second_turn_fault_masks_everything_after_the_first_tool_result() -> None:
    ids, mask, lps = fault_mask.break_layout(IDS, MASK, LPS, "second_turn")
    assert (ids, lps) == (IDS, LPS) and mask == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert fault_mask.break_layout([1, 2], [1, 1], None, "second_turn") == ([1, 2], [1, 1], None)


def test_misaligned_fault_trains_the_tool_tokens_instead_of_the_models() -> None:
    ids, mask, lps = fault_mask.break_layout(IDS, MASK, LPS, "misaligned")
    assert (ids, lps) == (IDS, LPS) and mask == [1, 1, 1, 1, 1, 0, 0, 1, 0, 0]


def test_drop_separator_fault_removes_each_interpreter_blocks_first_token() -> None:
    ids, mask, lps = fault_mask.break_layout(IDS, MASK, LPS, "drop_separator")
    assert ids == [1, 2, 3, 91, 4, 5, 93, 6]
    assert mask == [1, 1, 1, 0, 1, 1, 0, 1] and lps == [-0.1, -0.2, -0.3, 0.0, -0.4, -0.5, 0.0, -0.6]


def test_an_unknown_fault_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fault_mask.FAULT_MULTITURN_MASK, "third_turn")
    with pytest.raises(ValueError, match="second_turn"):
        fault_mask.mode()
