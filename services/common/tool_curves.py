"""The ReTool curves of a set of trajectories: how the model uses the code tool, and whether it
recovers when a call fails.

Invariants (one definition, used by the trainer per step and by evaluations):
- ``accuracy``: correct responses / all responses;
- ``recovery_rate``: correct / responses whose *first* tool call ended in an error (``None`` when
  no first call failed: a rate over nothing is not 0);
- ``first_call_success_rate``: responses whose first call succeeded / responses with a call
  (``None`` without calls);
- ``code_calls_mean``: tool calls per response, all responses;
- ``first_code_token_mean``: response tokens before the first call's opening tag, over responses
  with a call (``None`` without calls);
- ``response_length_mean``: response tokens (generated + interpreter), all responses;
- ``first_call_errors`` and ``multi_call_responses`` (>= 2 calls) are counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.schemas import Trajectory


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def tool_curves(trajs: Sequence[Trajectory]) -> dict[str, float | None]:
    if not trajs:
        raise ValueError("no trajectories")
    called = [t for t in trajs if t.tool_call_errors]
    failed_first = [t for t in called if t.tool_call_errors[0]]
    return {
        "accuracy": sum(bool(t.correct) for t in trajs) / len(trajs),
        "recovery_rate": _mean([float(bool(t.correct)) for t in failed_first]),
        "first_call_success_rate": _mean([float(not t.tool_call_errors[0]) for t in called]),
        "code_calls_mean": sum(t.tool_calls for t in trajs) / len(trajs),
        "first_code_token_mean": _mean([float(t.first_code_token) for t in called
                                        if t.first_code_token is not None]),
        "response_length_mean": sum(len(t.response_ids) for t in trajs) / len(trajs),
        "first_call_errors": float(len(failed_first)),
        "multi_call_responses": float(sum(t.tool_calls >= 2 for t in trajs)),
    }
