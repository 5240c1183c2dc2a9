"""Each HTTP service answers only what its own ``/openapi.json`` declares (issue 33, item 7).

schemathesis generates requests from the document (valid ones and invalid ones), sends them to the
real service on loopback with its bearer token, and checks every answer: no server error, a status
the document lists for that route, and a body that matches the declared model (our error bodies:
``services.common.errors``). The number of examples is bounded so that the file stays short on a
loaded machine; the run is derandomized (the same requests every time).

The token is read by the services from a file and is never in their logs or in a failure message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")  # the dev extra

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from services.common.errors import ApiError  # noqa: E402
from services.common.process import ServiceProcess  # noqa: E402
from services.sandbox.launcher import SandboxProcess  # noqa: E402

pytestmark = pytest.mark.integration

TOKEN = "conformance-bearer-5b1e9d"  # a test value; never printed
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # /openapi.json is behind the door too
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]
EXAMPLES = 5  # per route and generation mode: the whole file stays near 2 minutes on 2 loaded cores


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secrets") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def _conform(base: str, log: Path, examples: int = EXAMPLES) -> int:
    """Run schemathesis over every documented route; returns how many requests were sent."""
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=AUTH)
    failures: list[str] = []
    sent = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(mode))
            def run(case: schemathesis.Case) -> None:
                nonlocal sent
                sent += 1
                case.call_and_validate(base_url=base, headers=AUTH,
                                       checks=CHECKS, timeout=60)

            try:
                run()
            except Unsatisfiable:  # no invalid request exists (no body, a free-text path parameter)
                assert mode is GenerationMode.NEGATIVE, operation.label
            except (Exception, BaseExceptionGroup) as exc:  # schemathesis raises a FailureGroup
                failures.append(f"{operation.label} ({mode.value}): {_text(exc)}"[:3000])
    report = "\n\n".join(failures).replace(TOKEN, "<token>")
    assert not failures, report
    assert TOKEN not in log.read_text(errors="replace")  # the service never logged it
    return sent


def _text(exc: BaseException) -> str:
    """The failure and, for a group, each failure in it (schemathesis filters the Authorization
    header out of its reproduction commands; the token is masked below as well)."""
    parts = [str(exc)]
    if isinstance(exc, BaseExceptionGroup):
        parts += [_text(sub) for sub in exc.exceptions]
    return "\n".join(parts)


def _refused_without_token(base: str, path: str, body: dict) -> None:
    """The door answers 401 with the documented ``ApiError`` body, and the document lists it."""
    r = httpx.post(f"{base}{path}", json=body, timeout=30)
    assert r.status_code == 401 and ApiError.model_validate(r.json()).detail
    doc = httpx.get(f"{base}/openapi.json", headers=AUTH, timeout=30).json()
    assert "401" in doc["paths"][path]["post"]["responses"]


@pytest.fixture(scope="module")
def sandbox_service(tmp_path_factory, token_file) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("sandbox-conformance") / "sandbox.log"
    args = ["--set", "max_concurrency=4", "--set", "zygotes=1", "--set", "light_zygotes=1",
            "--set", "max_sessions=2", "--set", "default_run_timeout_s=5", "--set", "max_run_timeout_s=5",
            "--set", "max_output_bytes=4096"]
    env = {"RETOOL_SANDBOX__SECURITY__TOKEN__FILE": str(token_file)}
    with SandboxProcess(args, log_path=str(log), env=env) as proc:
        yield proc.url, log


@pytest.fixture(scope="module")
def reward_service(tmp_path_factory, token_file) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("reward-conformance") / "reward.log"
    env = {"RETOOL_REWARD__SECURITY__TOKEN__FILE": str(token_file)}
    with ServiceProcess(["reward", "serve", "--set", "workers=1"], log_path=log, env=env) as proc:
        yield proc.url, log


@pytest.fixture(scope="module")
def rollout_service(tmp_path_factory, token_file, sandbox_url) -> Iterator[tuple[str, Path]]:
    """The rollout service on a tiny local model (transformers engine), short answers."""
    from tests.helpers.tiny_model import tiny_model_dir

    work = tmp_path_factory.mktemp("rollout-conformance")
    cfg = work / "rollout.json"
    cfg.write_text(json.dumps({"max_n": 2, "max_prompt_tokens": 256,
                               "agent": {"max_turns": 1, "max_response_tokens": 16}}))
    model = tiny_model_dir(tmp_path_factory)
    args = ["rollout", "serve", "--model", str(model), "--sandbox-url", sandbox_url, "--config", str(cfg)]
    env = {"RETOOL_ROLLOUT__SECURITY__TOKEN__FILE": str(token_file)}
    with ServiceProcess(args, env=env, log_path=work / "rollout.log", startup_timeout_s=120) as proc:
        yield proc.url, work / "rollout.log"


def test_sandbox_answers_only_what_its_openapi_document_declares(sandbox_service):
    base, log = sandbox_service
    _refused_without_token(base, "/run_code", {"code": "print(1)", "language": "python"})
    assert _conform(base, log) > 0
    # the one 422 our own code sends (not FastAPI's) has FastAPI's shape too: the field is in loc
    r = httpx.post(f"{base}/run_code", headers=AUTH, timeout=30,
                   json={"code": "1", "language": "python", "session_id": "x", "stdin": "in"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "stdin"], r.text


def test_reward_answers_only_what_its_openapi_document_declares(reward_service):
    base, log = reward_service
    _refused_without_token(base, "/score", {"response": "\\boxed{1}", "ground_truth": "1"})
    assert _conform(base, log) > 0


def test_rollout_and_its_openai_routes_answer_only_what_the_document_declares(rollout_service):
    base, log = rollout_service
    _refused_without_token(base, "/v1/rollouts", {"prompt_ids": [1, 2], "n": 1})
    assert _conform(base, log, examples=3) > 0  # each example generates (a tiny model, 16 tokens)
    doc = httpx.get(f"{base}/openapi.json", headers=AUTH, timeout=30).json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]) == {"200", "400", "401", "404", "429", "500", "503"}
    assert "ErrorResponse" in json.dumps(chat["responses"]["400"])  # OpenAI's shape, for its clients
    assert set(doc["paths"]["/v1/rollouts"]["post"]["responses"]) == {
        "200", "400", "401", "422", "429", "502", "503"}


def test_every_error_status_is_declared_with_the_one_error_shape(sandbox_service, reward_service):
    """What the runs above cannot all provoke (a full queue, an overloaded grader): each route's
    document names every status its code sends, with ``ApiError`` (or FastAPI's 422) as the body."""
    expected = {
        ("sandbox", "/run_code", "post"): {"200", "400", "401", "404", "410", "422", "504"},
        ("sandbox", "/sessions", "post"): {"200", "400", "401", "422", "429", "503"},
        ("sandbox", "/sessions/{session_id}", "get"): {"200", "401", "404", "410", "422"},
        ("sandbox", "/sessions/{session_id}", "delete"): {"200", "401", "404", "422"},
        ("sandbox", "/run_jupyter", "post"): {"200", "400", "401", "404", "410", "422", "429", "503"},
        ("sandbox", "/healthz", "get"): {"200", "503"},
        ("reward", "/score", "post"): {"200", "400", "401", "422", "503"},
        ("reward", "/score/batch", "post"): {"200", "400", "401", "422", "503"},
        ("reward", "/healthz", "get"): {"200", "503"},
    }
    docs = {name: httpx.get(f"{svc[0]}/openapi.json", headers=AUTH, timeout=30).json()
            for name, svc in (("sandbox", sandbox_service), ("reward", reward_service))}
    for (name, path, method), statuses in expected.items():
        declared = docs[name]["paths"][path][method]["responses"]
        assert set(declared) == statuses, (name, path, method, sorted(declared))
        for status, spec in declared.items():
            ref = json.dumps(spec.get("content", {}))
            if status == "422":
                assert "HTTPValidationError" in ref or "ValidationErrorBody" in ref, (name, path)
            elif status.startswith(("4", "5")) and path != "/healthz":
                assert "ApiError" in ref, (name, path, status)
