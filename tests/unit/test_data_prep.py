import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from services.data.aime import prepare_aime
from services.data.dapo import TOOL_INSTRUCTION, prepare_dapo, problem_text
from services.data.retool_sft import TraceError, prepare_retool_sft, split_trace, to_messages
from tests.helpers.datasets import (
    dapo_row,
    retool_sft_row,
    write_aime_2024,
    write_aime_2025,
    write_dapo,
    write_retool_sft,
)


def _dapo_file(tmp_path):
    rows = []
    for _ in range(3):  # the published file repeats every problem many times
        rows.append(dapo_row("Find $x$ if $x+1=35$.", "34"))
        rows.append(dapo_row("Compute  113 + 0.", "113"))
        rows.append(dapo_row("Solve $2x=-6$.", "-3"))
    rows.append(dapo_row("A problem without an answer.", ""))  # bad: empty ground truth
    rows.append(dapo_row("Only a system message.", "7", user=False))  # bad: no user message
    return write_dapo(tmp_path / "dapo-math-17k.parquet", rows)


def test_dapo_validates_dedupes_and_reports(tmp_path):
    report = prepare_dapo(_dapo_file(tmp_path), tmp_path / "train.parquet")
    assert report.rows_read == 11 and report.rows_written == 3 and report.duplicates == 6
    assert report.bad_rows == 2
    assert {b.index for b in report.bad} == {9, 10}
    assert "ground_truth" in report.bad[0].reason and "user" in report.bad[1].reason
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["34", "113", "-3"]
    assert set(rows[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert rows[0]["extra_info"]["problem"] == "Find $x$ if $x+1=35$."
    assert rows[0]["prompt"][0]["role"] == "user" and "Answer:" in rows[0]["prompt"][0]["content"]


def test_dapo_whitespace_and_case_variants_are_duplicates(tmp_path):
    rows = [dapo_row("Find  X.", "1"), dapo_row("find x.", "1"), dapo_row("find x.", "2")]
    report = prepare_dapo(write_dapo(tmp_path / "d.parquet", rows), tmp_path / "o.parquet")
    assert report.duplicates == 1 and report.rows_written == 2  # same text, other answer: kept


def test_dapo_tool_instruction_and_no_dedupe(tmp_path):
    out = tmp_path / "train.parquet"
    report = prepare_dapo(_dapo_file(tmp_path), out, tool_instruction=True, dedupe=False)
    assert report.rows_written == 9 and report.duplicates == 0
    assert pq.read_table(out).to_pylist()[0]["prompt"][0]["content"].endswith(TOOL_INSTRUCTION)


def test_problem_text_strips_only_the_dapo_wrapper():
    assert problem_text("plain question") == "plain question"


TRACE = (
    "Let me compute.\n<code>\n```python\nprint(2**10)\n```\n</code>\n<interpreter>\n1024\n</interpreter>\n"
    "So it is 1024. Check again.<code>print(1024 % 7)</code><interpreter>2</interpreter>\n"
    "<answer>\n\\boxed{1024}\n</answer>"
)


def test_trace_to_code_format_messages():
    msgs = to_messages("What is 2^10?", TRACE, "code")
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert msgs[1]["content"] == "Let me compute.\n<code>\n```python\nprint(2**10)\n```\n</code>"
    assert msgs[2]["content"] == "1024"
    assert "print(1024 % 7)" in msgs[3]["content"]
    assert msgs[5]["content"].startswith("<answer>") and "\\boxed{1024}" in msgs[5]["content"]
    assert all(m["tool_calls"] is None for m in msgs)


def test_trace_to_hermes_messages():
    msgs = to_messages("What is 2^10?", TRACE, "hermes")
    call = msgs[1]["tool_calls"][0]["function"]
    assert call["name"] == "code_interpreter"
    assert json.loads(call["arguments"]) == {"code": "print(2**10)"}
    assert msgs[1]["content"] == "Let me compute."
    assert "<code>" not in msgs[3]["content"] and "<answer>" not in msgs[5]["content"]


@pytest.mark.parametrize(
    "trace,reason",
    [
        ("<code>print(1)", "never closed"),
        ("<interpreter>1</interpreter><answer>1</answer>", "out of order"),
        ("<code>a<code>b</code></code>", "inside"),
        ("<code>print(1)</code><answer>1</answer>", "out of order"),
        ("<code>x</code><interpreter>1</interpreter>", "does not end with an <answer>"),
        ("text </code>", "without matching"),
        ("no tags at all", "does not end with an <answer>"),
    ],
)
def test_bad_traces_are_rejected_with_a_reason(trace, reason):
    with pytest.raises(TraceError, match=reason):
        split_trace(trace)


def test_retool_sft_file_reports_and_skips_bad_samples(tmp_path):
    rows = [
        retool_sft_row("What is 2^10?", TRACE),
        retool_sft_row("Broken", "<code>oops"),
        retool_sft_row("Direct", "It is 4.<answer>\\boxed{4}</answer>"),
    ]
    src = write_retool_sft(tmp_path / "train-00000-of-00001.parquet", rows)
    report = prepare_retool_sft(src, tmp_path / "sft.parquet", fmt="code")
    assert report.rows_written == 2 and report.bad_rows == 1 and report.bad[0].index == 1
    out = pq.read_table(tmp_path / "sft.parquet").to_pylist()
    assert out[0]["messages"][0]["content"].startswith("What is 2^10?")
    assert "*user question:*" not in out[0]["messages"][0]["content"]
    assert out[0]["num_tool_calls"] == 2 and out[1]["num_tool_calls"] == 0


def test_retool_sft_wrong_columns_is_a_clear_error(tmp_path):
    src = write_dapo(tmp_path / "d.parquet", [dapo_row("x", "1")])
    with pytest.raises(ValueError, match="messages"):
        prepare_retool_sft(src, tmp_path / "o.parquet")


def test_aime_both_public_layouts(tmp_path):
    a24 = write_aime_2024(
        tmp_path / "aime_2024.parquet", [("2024-I-1", "Problem one", 204), ("2024-I-2", "Problem two", 25)]
    )
    a25 = write_aime_2025(
        tmp_path / "aime_2025.parquet", [("0", "P", "70"), ("1", "Q", "x=3"), ("2", "R", "1000")]
    )
    r24 = prepare_aime(a24, tmp_path / "v24.parquet")
    r25 = prepare_aime(a25, tmp_path / "v25.parquet")
    assert r24.rows_written == 2 and r24.bad_rows == 0
    assert r25.rows_written == 1 and r25.bad_rows == 2
    rows = pq.read_table(tmp_path / "v24.parquet").to_pylist()
    assert rows[0]["data_source"] == "aime_2024" and rows[0]["reward_model"]["ground_truth"] == "204"
    assert "Problem one" in rows[0]["prompt"][0]["content"]


def test_cli_dapo_prints_the_report(tmp_path):
    src = _dapo_file(tmp_path)
    out = tmp_path / "cli.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "data", "dapo", "-i", str(src), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 3" in proc.stdout and "removed 6 duplicates" in proc.stdout and "row 9:" in proc.stdout
    assert pq.read_table(out).num_rows == 3
