"""``scale.png``: where the time and the CPU go in one ``bench/scale.py`` run, drawn from its ``scale.json``.

Two panels, both from the report's own figures (nothing is re-measured here):
- left, **per step (wall seconds)**: the step, the engine's generation (time some sequence could
  run), the tools (sum over trajectories: calls overlap each other and generation), the trainer's
  packing and the weight push; the bars are not stacked because the phases overlap (a step with
  ``max_staleness`` >= 1 generates the next batch while it trains), on a log scale (packing and the
  push take milliseconds beside minutes of generation);
- right, **CPU-seconds per 1M generated tokens** of each component's process tree, the rollout
  process minus the engine's own step work beside it (what a GPU engine would do instead).

The title names the step mode (``null``: forward and backward skipped), the preset and the shape, so
the figure is never read as a GPU training run.

    python bench/scale_figure.py runs/scale/scale.json [--out runs/scale/scale.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def render(report: dict[str, Any], path: Path) -> Path:
    """Draw the report's figure to ``path`` (PNG, Agg backend: no display needed); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_step = {k: float(v) for k, v in report["per_step_s"].items()}
    cpu = {k: float(v) for k, v in report["cpu_s_per_1M_tokens"].items()}
    shape = report["shape"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})
    names = list(per_step)
    left.barh(names, [per_step[n] for n in names], color="#4c72b0")
    left.invert_yaxis()
    left.set_xscale("log")  # packing and the push are milliseconds beside minutes of generation
    left.set_xlabel("seconds per step, log scale (phases overlap: not stacked)")
    left.set_title("where a step's time goes")
    for i, n in enumerate(names):
        left.text(per_step[n], i, f" {per_step[n]:g}", va="center", fontsize=8)
    comps = sorted(cpu, key=lambda k: -cpu[k])
    colors = ["#dd8452" if k == "rollout minus engine step work" else "#55a868" for k in comps]
    right.barh(comps, [cpu[k] for k in comps], color=colors)
    right.invert_yaxis()
    right.set_xlabel("CPU-seconds per 1M generated tokens")
    right.set_title("where the CPU goes (orange: the rollout's own)")
    for i, k in enumerate(comps):
        right.text(cpu[k], i, f" {cpu[k]:g}", va="center", fontsize=8)
    idle = report.get("engine_idle_fraction")
    fig.suptitle(
        f"bench/scale.py, step_mode={report['step_mode']} (no forward/backward), preset {report['preset']}"
        f"{' (--quick)' if report.get('quick') else ''}: "
        f"{shape['responses_per_step']} responses/step x up to "
        f"{shape['max_response_tokens']:,} tokens, {report['steps']} steps, "
        f"{report['generated_tokens']:,} tokens; engine idle {idle if idle is not None else 'n/a'}; "
        f"wire {report['wire_bytes_per_token']} B/token",
        fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report", type=Path, help="a scale.json written by bench/scale.py")
    ap.add_argument("--out", type=Path, help="default: scale.png beside the report")
    args = ap.parse_args()
    out = render(json.loads(args.report.read_text()), args.out or args.report.with_name("scale.png"))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
