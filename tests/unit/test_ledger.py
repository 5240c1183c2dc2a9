"""The training ledger: durable records, torn tails, and the exactly-once invariant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.trainer.ledger import LedgerWriter, check, check_file, read_records

REPO = Path(__file__).resolve().parents[2]


def _run(path: Path) -> LedgerWriter:
    """A clean run: 4 jobs admitted, step 1 trains two, one dropped stale, checkpoint, end."""
    w = LedgerWriter(path)
    w.write("resume", step=0)
    w.admit(["a:0", "a:1", "a:2", "a:3"])
    w.trained(1, ["a:0", "a:1"])
    w.drop("a:2", "stale")
    w.write("checkpoint", step=1)
    return w


def test_a_clean_run_holds_the_invariant(tmp_path):
    w = _run(tmp_path / "l.jsonl")
    w.write("end", step=1, outstanding=1)
    w.close()
    rep = check_file(tmp_path / "l.jsonl")
    assert rep.ok, rep.violations
    assert (rep.admitted, rep.trained_groups, rep.steps, rep.outstanding) == (4, 2, 1, 1)
    assert rep.dropped == {"stale": 1}


def test_a_job_trained_twice_is_a_violation(tmp_path):
    w = _run(tmp_path / "l.jsonl")
    w.trained(2, ["a:1", "a:3"])
    w.close()
    rep = check_file(tmp_path / "l.jsonl")
    assert not rep.ok and "a:1 already trained at step 1" in rep.violations[0]


def test_a_job_trained_and_dropped_is_a_violation(tmp_path):
    w = _run(tmp_path / "l.jsonl")
    w.drop("a:0", "filtered")
    w.close()
    assert "a:0 already trained" in check_file(tmp_path / "l.jsonl").violations[0]


def test_a_resume_rolls_back_to_its_checkpoint_so_a_redone_step_is_no_duplicate(tmp_path):
    w = _run(tmp_path / "l.jsonl")
    w.admit(["a:4", "a:5"])
    w.trained(2, ["a:3", "a:4"])  # lost: the trainer dies before the next checkpoint
    w.write("resume", step=1)
    w.admit(["a:4", "a:5"])  # the cursor went back with the checkpoint: the same ids again
    w.trained(2, ["a:4", "a:3"])
    w.write("checkpoint", step=2)
    w.write("end", step=2, outstanding=1)
    w.close()
    rep = check_file(tmp_path / "l.jsonl")
    assert rep.ok, rep.violations
    assert (rep.steps_redone, rep.groups_redone, rep.resumes) == (1, 2, [0, 1])


def test_a_resume_from_a_step_without_a_checkpoint_record_is_a_violation(tmp_path):
    w = _run(tmp_path / "l.jsonl")
    w.write("resume", step=7)
    w.close()
    assert "no checkpoint record" in check_file(tmp_path / "l.jsonl").violations[0]


def test_a_job_that_vanished_without_a_record_breaks_the_end_count(tmp_path):
    w = _run(tmp_path / "l.jsonl")
    w.write("end", step=1, outstanding=0)  # the trainer counts nothing in flight; the ledger has a:3
    w.close()
    assert "vanished without a record" in check_file(tmp_path / "l.jsonl").violations[0]


def test_resolving_a_job_never_admitted_and_skipped_steps_are_violations():
    from services.trainer.ledger import Record

    recs = [Record(t="admit", job_ids=["x:0"]), Record(t="trained", step=2, job_ids=["y:0", "y:0"])]
    v = check(recs).violations
    assert any("step 2 follows step 0" in x for x in v)
    assert any("trained a group twice" in x for x in v)
    assert any("y:0 resolved but never admitted" in x for x in v)


def test_a_torn_last_line_is_ignored_then_cut_by_the_next_writer(tmp_path):
    path = tmp_path / "l.jsonl"
    _run(path).close()
    good = path.read_bytes()
    path.write_bytes(good + b'{"t": "trained", "step": 2, "job_')  # SIGKILL mid-write
    records, torn = read_records(path)
    assert torn and len(records) == len(good.splitlines())
    assert check_file(path).ok and check_file(path).torn_tail
    LedgerWriter(path).close()
    assert path.read_bytes() == good


def test_a_torn_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "l.jsonl"
    _run(path).close()
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:10]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="line 3 is not a ledger record"):
        read_records(path)


def test_records_are_validated():
    from pydantic import ValidationError

    from services.trainer.ledger import Record

    with pytest.raises(ValidationError):
        Record.model_validate({"t": "drop", "job_id": "a", "reason": "because"})


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "trainer", "ledger", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_cli_checks_a_directory_and_exits_1_on_a_violation(tmp_path):
    w = _run(tmp_path / "ledger.jsonl")
    w.write("end", step=1, outstanding=1)
    w.close()
    ok = _cli(str(tmp_path), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.splitlines()[-1])["ok"] is True
    w = LedgerWriter(tmp_path / "ledger.jsonl")
    w.trained(2, ["a:0"])
    w.close()
    broken = _cli(str(tmp_path / "ledger.jsonl"), "--print")
    assert broken.returncode == 1
    assert "VIOLATION" in broken.stdout and "ledger BROKEN" in broken.stdout and "trained" in broken.stdout
    missing = _cli(str(tmp_path / "nothing"))
    assert missing.returncode != 0 and "no ledger at" in missing.stderr
