"""Session pieces that need no sandbox: cell compilation, limits, request validation, labels."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.sandbox.config import SandboxConfig
from services.sandbox.session_main import _compile_cell
from services.sandbox.session_runner import _error_info
from services.sandbox.sessions import SessionLimit, SessionRegistry, SessionUnknown, reason_kind
from services.transport.sandbox.schemas import RunCodeRequest, RunJupyterRequest


def _shown(source: str) -> object:
    ns: dict[str, object] = {}
    body, last = _compile_cell(source, "cell_1.py")
    exec(body, ns)  # noqa: S102 - our own test source
    return eval(last, ns) if last is not None else "<nothing>"  # noqa: S307


@pytest.mark.parametrize("source,shown", [
    ("a = 2\na * 21", 42),
    ("a = 1; a + 1", 2),                 # the last statement of the line, as a notebook shows it
    ("x = 5  # no expression", "<nothing>"),
    ("for i in range(3):\n    i", "<nothing>"),
    ("print('side effect')", None),      # evaluated once; None is not displayed
    ("", "<nothing>"),
])
def test_last_line_expression_is_evaluated_for_display(source, shown):
    assert _shown(source) == shown


def test_syntax_errors_name_the_cell():
    with pytest.raises(SyntaxError) as exc:
        _compile_cell("x = (\n", "cell_3.py")
    assert exc.value.filename == "cell_3.py"


def test_impossible_session_settings_are_refused_before_start():
    with pytest.raises(ValidationError, match="session_idle_ttl_s"):
        SandboxConfig(session_idle_ttl_s=100, max_session_idle_ttl_s=10)
    with pytest.raises(ValidationError, match="max_sessions"):
        SandboxConfig(uid_base=65000, max_concurrency=128, max_sessions=600)
    assert SandboxConfig(max_sessions=0).max_sessions == 0


def test_run_jupyter_requests_are_validated_per_field():
    ok = RunJupyterRequest(cells=["a = 1", "a"])
    assert ok.kernel == "python3" and ok.total_timeout == 45 and ok.session_id is None
    for bad, field in (({"cells": []}, "cells"), ({"cells": ["1"], "kernel": "ruby"}, "kernel"),
                       ({"cells": ["1"], "files": {"../x": "AA=="}}, "files"),
                       ({"cells": ["1"], "files": {"x": "not base64!"}}, "files"),
                       ({"cells": ["1"], "total_timeout": 0}, "total_timeout")):
        with pytest.raises(ValidationError) as exc:
            RunJupyterRequest(**bad)
        assert field in str(exc.value)
    assert RunCodeRequest(code="x", session_id="abc").session_id == "abc"
    with pytest.raises(ValidationError, match="session_id"):
        RunCodeRequest(code="x", session_id="s" * 65)


def test_end_reasons_map_to_metric_labels():
    assert reason_kind("a cell ran past its time limit of 1 s") == "cell_timeout"
    assert reason_kind("it exceeded its memory limit of 256 MB (killed by the OOM killer)") == "memory"
    assert reason_kind("it was idle longer than its TTL of 1 s") == "expired"
    assert reason_kind("it was closed") == "closed"
    assert reason_kind("it reached its lifetime limit of 7200 s") == "lifetime"
    assert reason_kind("its sandbox worker no longer holds it (the worker restarted)") == "worker_lost"
    assert reason_kind("its interpreter exited with code 3") == "died"


def test_error_fields_forged_by_a_cell_are_reduced_to_strings():
    assert _error_info({"ename": b"X", "evalue": 3, "traceback": [1, b"y"], "extra": object()}) == {
        "ename": "b'X'", "evalue": "3", "traceback": ["1", "b'y'"]}
    assert _error_info("nope") is None and _error_info({"traceback": "x"})["traceback"] == []


async def test_sessions_off_is_a_clear_refusal():
    registry = SessionRegistry(SandboxConfig(max_sessions=0), [], lambda index: None)
    with pytest.raises(SessionLimit, match="sessions are off"):
        await registry.open(None, -1)
    with pytest.raises(SessionUnknown):
        registry.get("nope")
