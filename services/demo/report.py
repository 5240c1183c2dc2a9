"""The demo's plot: training-batch accuracy and tool-use rate per GRPO step, with the held-out
evaluations before and after RL as markers. With the recovery task's curves in the records
(``recovery_rate`` …, services/common/tool_curves.py) two more panels show them the same way:
the rates (recovery, first-call success), then the sizes (response length and position of the
first ``<code>`` in tokens, code calls per response). Reads only the demo's ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MARKS = (("before", "^"), ("after", "v"))


def _curve(ax: Any, steps: list[int], grpo: list[dict[str, Any]], evals: dict[str, dict[str, Any]],
           key: str, label: str, color: str, marker: str) -> None:
    ys = [r.get(key) for r in grpo]
    pts = [(s, y) for s, y in zip(steps, ys, strict=True) if y is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], f"-{marker}", ms=3, c=color,
            label=f"{label} (training)")
    last = max(steps, default=1)
    for when, m in MARKS:
        value = evals.get(when, {}).get(key)
        if value is not None:
            ax.scatter([0 if when == "before" else last], [value], marker=m, s=70, c=color, zorder=3,
                       label=f"held-out {when}: {value:.2f}")


def plot(metrics: Path, out: Path) -> Path:
    # lazy: matplotlib costs ~3 s of import and only the plots need it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    grpo = [r for r in recs if r.get("phase") == "grpo"]
    evals = {r["when"]: r for r in recs if r.get("phase") == "eval"}
    recovery = any("recovery_rate" in r for r in grpo)
    fig, axes = plt.subplots(3 if recovery else 1, 1, figsize=(7, 11 if recovery else 4), squeeze=False)
    ax = axes[0][0]
    steps = [r["step"] for r in grpo]
    _curve(ax, steps, grpo, evals, "accuracy", "accuracy", "C0", "o")
    _curve(ax, steps, grpo, evals, "tool_use_rate", "tool-use rate", "C1", "s")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("retool demo --task recovery: accuracy and tool use" if recovery
                 else "retool demo: learning to use the code tool")
    if recovery:
        ax = axes[1][0]
        _curve(ax, steps, grpo, evals, "recovery_rate", "recovery rate P(ok | 1st call raised)", "C2", "o")
        _curve(ax, steps, grpo, evals, "first_call_success_rate", "first-call success rate", "C3", "s")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("recovering from an interpreter error")
        ax = axes[2][0]
        _curve(ax, steps, grpo, evals, "response_length_mean", "response length (tokens)", "C4", "o")
        _curve(ax, steps, grpo, evals, "first_code_token_mean", "first <code> at token", "C5", "s")
        ax.set_ylabel("tokens")
        twin = ax.twinx()
        _curve(twin, steps, grpo, evals, "code_calls_mean", "code calls per response", "C6", "d")
        twin.set_ylabel("code calls per response")
        twin.legend(fontsize=7, loc="center right")
        ax.set_title("sizes")
    for row in axes:
        row[0].set_xlabel("GRPO step")
        row[0].legend(fontsize=7, loc="lower right" if row[0] is not axes[-1][0] else "lower left")
        row[0].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
