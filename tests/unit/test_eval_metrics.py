"""retool eval: metrics of scored groups (hand-computed), config errors, Markdown and PNG outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.schemas import Group, PromptJob, Trajectory
from services.eval.metrics import reference_metrics, summarize
from services.eval.report import curves, markdown, mean_at_n
from services.eval.run import EvalConfig, EvalReport, write_outputs

PNG = b"\x89PNG\r\n\x1a\n"


def traj(*, correct: bool | None, reward: float | None, calls: int = 0, errors: int = 0, turns: int = 1,
         length: int = 4, generated: int = 4, finish: str = "eos", truncated: bool = False,
         extracted: str | None = None) -> Trajectory:
    mask = [1] * generated + [0] * (length - generated)
    return Trajectory(response_ids=list(range(length)), loss_mask=mask, logprobs=[0.0] * length,
                      versions=[0 if m else -1 for m in mask], turns=turns, tool_calls=calls,
                      tool_errors=errors, finish_reason=finish, truncated=truncated, reward=reward,
                      correct=correct, extracted=extracted)  # type: ignore[arg-type]


def group(job_id: str, trajs: list[Trajectory]) -> Group:
    return Group(job_id=job_id, prompt_ids=[1, 2],
                 trajectories=[t.model_copy(update={"index": i}) for i, t in enumerate(trajs)])


def job(job_id: str, source: str) -> PromptJob:
    return PromptJob(job_id=job_id, messages=[{"role": "user", "content": "q"}], ground_truth="1", n=2,
                     data_source=source)  # type: ignore[list-item]


@pytest.fixture
def scored() -> tuple[list[PromptJob], list[Group]]:
    a = group("a", [traj(correct=True, reward=1.0, calls=2, errors=1, turns=3, length=10, generated=6,
                         extracted="7"),
                    traj(correct=False, reward=-1.0, turns=1, length=4, generated=4, extracted="8")])
    b = group("b", [traj(correct=True, reward=1.0, calls=1, turns=2, length=8, generated=5, extracted="3"),
                    traj(correct=None, reward=None, calls=1, errors=1, turns=2, length=6, generated=3,
                         finish="length", truncated=True, extracted="3")])
    return [job("a", "org/aime_2024"), job("b", "org/aime_2024")], [a, b]


def test_summary_matches_a_hand_count(scored) -> None:
    _, groups = scored
    s = summarize(groups)
    assert (s.prompts, s.responses) == (2, 4)
    assert s.accuracy == pytest.approx(2 / 4)
    assert s.reward_mean == pytest.approx((1 - 1 + 1 + 0) / 4)  # no reward counts as 0
    assert s.tool_use_rate == pytest.approx(3 / 4)
    assert s.tool_calls_per_response == pytest.approx(4 / 4)
    assert s.tool_error_rate == pytest.approx(2 / 4)  # per call, not per response
    assert (s.num_turns.min, s.num_turns.max, s.num_turns.mean) == (1, 3, 2)
    assert (s.response_length.min, s.response_length.max, s.response_length.mean) == (4, 10, 7)
    assert s.generated_tokens_mean == pytest.approx((6 + 4 + 5 + 3) / 4)
    assert s.truncated_rate == pytest.approx(1 / 4)
    assert s.finish_reasons == {"eos": 3, "length": 1}


def test_no_tool_calls_is_a_zero_error_rate_and_no_responses_is_an_error() -> None:
    assert summarize([group("a", [traj(correct=True, reward=1.0)])]).tool_error_rate == 0.0
    with pytest.raises(ValueError, match="no responses"):
        summarize([])


def test_reference_metrics_per_problem_then_per_source(scored) -> None:
    jobs, groups = scored
    m = reference_metrics(jobs, groups, n_bootstrap=200, seed=1)
    # per problem acc: a = [1, 0] -> 0.5, b = [1, 0] -> 0.5
    assert m["val-core/org/aime_2024/acc/mean@2"] == pytest.approx(0.5)
    # majority value = the value of the first draw of the winning answer (verl): here the first
    # draw of each resample, so ~0.5 for both problems
    assert 0.4 < m["val-core/org/aime_2024/acc/maj@2/mean"] < 0.6
    assert m["val-core/org/aime_2024/acc/best@2/mean"] >= m["val-aux/org/aime_2024/acc/worst@2/mean"]
    assert m["val-aux/num_turns/mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        reference_metrics(jobs[:1], groups)  # groups[i] must answer jobs[i]


def test_curves_parse_sources_with_slashes() -> None:
    m = {"val-core/org/aime/acc/best@4/mean": 0.9, "val-aux/org/aime/acc/best@2/mean": 0.7,
         "val-core/org/aime/acc/mean@4": 0.4, "val-aux/org/aime/reward/best@2/mean": 0.1,
         "val-aux/org/aime/acc/best@2/std": 0.05}
    assert curves(m) == {"org/aime": {"best": [(2, 0.7), (4, 0.9)]}}
    assert mean_at_n(m) == {"org/aime": (4, 0.4)}


def _config(tmp_path: Path, **values: object) -> EvalConfig:
    data = tmp_path / "d.parquet"
    data.write_bytes(b"x")
    return load_config(EvalConfig, values={"data": str(data), **values})


@pytest.mark.parametrize(("values", "message"), [
    ({}, "either 'model'"),
    ({"model": "m", "rollout_urls": ["http://x"]}, "not both"),
    ({"rollout_urls": ["http://x"], "n": 0}, "n"),
])
def test_impossible_settings_are_config_errors(tmp_path, values, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **values)


def test_missing_data_and_model_are_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match="data: file .* does not exist"):
        load_config(EvalConfig, values={"data": str(tmp_path / "nope.parquet"), "rollout_urls": ["http://x"]})
    with pytest.raises(ConfigError, match="no config.json"):
        _config(tmp_path, model=str(tmp_path))


def test_outputs_are_written_from_the_report(tmp_path, scored) -> None:
    jobs, groups = scored
    cfg = _config(tmp_path, rollout_urls=["http://x"], n=2, out_dir=str(tmp_path / "out"))
    metrics = reference_metrics(jobs, groups, seed=0)
    report = EvalReport(config=cfg, summary=summarize(groups), metrics=metrics, wall_seconds=1.5)
    out = tmp_path / "out"
    write_outputs(report, jobs, groups, out)
    md = (out / "report.md").read_text()
    assert "| org/aime_2024 (N=2) | 0.5000 |" in md
    assert "| tool error rate (per call) | 0.5000 |" in md
    assert EvalReport.model_validate_json((out / "report.json").read_text()) == report
    assert len((out / "samples.jsonl").read_text().splitlines()) == 4
    for png in ("accuracy_at_k.png", "distributions.png"):
        assert (out / png).read_bytes()[:8] == PNG
    assert markdown(report) == md  # re-rendered from the JSON alone
