"""The demo's plot reads metrics.jsonl as both demos write it: one panel for the multiplication
demo, three when the records carry the recovery curves (a missing rate is left out, not 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.demo.report import plot


def _write(path: Path, recovery: bool) -> Path:
    extra = {"recovery_rate": None, "first_call_success_rate": 0.2, "code_calls_mean": 1.1,
             "first_code_token_mean": 0.0, "response_length_mean": 70.0} if recovery else {}
    recs = [{"phase": "eval", "when": "before", "accuracy": 0.2, "tool_use_rate": 0.7, **extra}]
    recs += [{"phase": "grpo", "step": s, "accuracy": 0.1 * s, "tool_use_rate": 0.5, **extra,
              **({"recovery_rate": 0.3 + 0.1 * s} if recovery and s > 1 else {})} for s in (1, 2, 3)]
    recs.append({"phase": "eval", "when": "after", "accuracy": 0.6, "tool_use_rate": 0.9, **extra})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.mark.parametrize("recovery", [False, True], ids=["multiply", "recovery"])
def test_plot_writes_a_png_for_both_demos(tmp_path: Path, recovery: bool) -> None:
    from PIL import Image

    out = plot(_write(tmp_path / "metrics.jsonl", recovery), tmp_path / "progress.png")
    with Image.open(out) as img:
        width, height = img.size
    assert width > 0 and (height > width) == recovery  # three panels stacked when recovering
