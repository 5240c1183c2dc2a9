"""The demo's plot: training-batch accuracy and tool-use rate per GRPO step, with the held-out
evaluations before and after RL as markers. Reads only the demo's ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path


def plot(metrics: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    grpo = [r for r in recs if r.get("phase") == "grpo"]
    evals = {r["when"]: r for r in recs if r.get("phase") == "eval"}
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in grpo]
    ax.plot(steps, [r["accuracy"] for r in grpo], "-o", ms=3, label="accuracy (training rollouts)")
    ax.plot(steps, [r["tool_use_rate"] for r in grpo], "-s", ms=3, label="tool-use rate (training rollouts)")
    last = max(steps, default=1)
    for when, x, marker in (("before", 0, "^"), ("after", last, "v")):
        if when in evals:
            ax.scatter([x], [evals[when]["accuracy"]], marker=marker, s=80, c="C0", zorder=3,
                       label=f"held-out accuracy {when}: {evals[when]['accuracy']:.2f}")
            ax.scatter([x], [evals[when]["tool_use_rate"]], marker=marker, s=80, c="C1", zorder=3,
                       label=f"held-out tool use {when}: {evals[when]['tool_use_rate']:.2f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("retool demo: learning to use the code tool")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
