"""The evaluation's human-facing outputs: a Markdown summary and PNG plots.

Invariant: both are rendered from the ``EvalReport`` alone (what ``report.json`` holds), so a
report can be re-rendered later from its JSON.
"""

from __future__ import annotations

import re
from pathlib import Path

from services.eval.schemas import EvalReport

_CURVE = re.compile(r"^val-(?:core|aux)/(?P<src>.+)/acc/(?P<kind>best|worst|maj)@(?P<k>\d+)/mean$")
_MEAN = re.compile(r"^val-(?:core|aux)/(?P<src>.+)/acc/mean@(?P<n>\d+)$")


def curves(metrics: dict[str, float]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{source: {"best"|"worst"|"maj": [(k, value), …] sorted by k}}`` from reference names."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for name, value in metrics.items():
        m = _CURVE.match(name)
        if m:
            out.setdefault(m["src"], {}).setdefault(m["kind"], []).append((int(m["k"]), value))
    for kinds in out.values():
        for pts in kinds.values():
            pts.sort()
    return out


def mean_at_n(metrics: dict[str, float]) -> dict[str, tuple[int, float]]:
    out = {}
    for name, value in metrics.items():
        m = _MEAN.match(name)
        if m:
            out[m["src"]] = (int(m["n"]), value)
    return out


def markdown(report: EvalReport) -> str:
    s, c = report.summary, report.config
    lines = [
        "# ReTool evaluation",
        "",
        f"- model: `{c.model or '(running rollout service)'}`",
        f"- data: `{c.data}` ({s.prompts} prompts × {c.n} responses = {s.responses})",
        f"- sampling: temperature {c.temperature}, top_p {c.top_p}, "
        f"max_tokens {c.max_tokens or 'service default'}, "
        f"max_turns {c.max_turns if c.max_turns is not None else 'service default'}, seed {c.seed}",
        f"- wall time: {report.wall_seconds:.1f} s",
        "",
        "## Accuracy",
        "",
        "| source | mean@N | maj@N | best@N | worst@N |",
        "|---|---|---|---|---|",
    ]
    cv = curves(report.metrics)
    for src, (n, mean) in sorted(mean_at_n(report.metrics).items()):
        row = [f"{mean:.4f}"]
        for kind in ("maj", "best", "worst"):
            pts = dict(cv.get(src, {}).get(kind, []))
            row.append(f"{pts[n]:.4f}" if n in pts else "–")
        lines.append(f"| {src} (N={n}) | " + " | ".join(row) + " |")
    lines += [
        "",
        "## Tool use and responses",
        "",
        "| metric | value |",
        "|---|---|",
        f"| accuracy (all responses) | {s.accuracy:.4f} |",
        f"| reward mean | {s.reward_mean:.4f} |",
        f"| responses using the tool | {s.tool_use_rate:.4f} |",
        f"| tool calls per response | {s.tool_calls_per_response:.3f} |",
        f"| tool error rate (per call) | {s.tool_error_rate:.4f} |",
        f"| turns min / mean / max | {s.num_turns.min:g} / {s.num_turns.mean:.2f} / {s.num_turns.max:g} |",
        f"| response tokens min / mean / max | {s.response_length.min:g} / {s.response_length.mean:.1f} / "
        f"{s.response_length.max:g} |",
        f"| generated tokens mean | {s.generated_tokens_mean:.1f} |",
        f"| truncated | {s.truncated_rate:.4f} |",
        f"| finish reasons | {', '.join(f'{k} {v}' for k, v in sorted(s.finish_reasons.items()))} |",
        "",
        "Metric names in `report.json` follow the reference (`val-core/<source>/acc/mean@N`, …); "
        "best/worst/maj@k are bootstrap estimates over k of the N responses.",
        "",
    ]
    return "\n".join(lines)


def plot_curves(report: EvalReport, out: Path) -> Path:
    """best@k, maj@k and worst@k against k, one panel per data source."""
    # lazy: matplotlib costs ~3 s of import and only the plots need it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cv = curves(report.metrics)
    means = mean_at_n(report.metrics)
    sources = sorted(set(cv) | set(means)) or ["(none)"]
    fig, axes = plt.subplots(1, len(sources), figsize=(5 * len(sources), 3.6), squeeze=False)
    for ax, src in zip(axes[0], sources, strict=True):
        for kind, style in (("best", "-o"), ("maj", "-s"), ("worst", "-v")):
            pts = cv.get(src, {}).get(kind, [])
            if pts:
                ax.plot([k for k, _ in pts], [v for _, v in pts], style, ms=4, label=f"{kind}@k")
        if src in means:
            n, v = means[src]
            ax.axhline(v, ls="--", c="grey", label=f"mean@{n} = {v:.3f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (responses)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(src, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_distributions(turns: list[int], lengths: list[int], out: Path) -> Path:
    """Histograms of turns per response and of response length (tokens)."""
    # lazy: matplotlib costs ~3 s of import and only the plots need it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.hist(turns, bins=range(0, max(turns, default=0) + 2), align="left", rwidth=0.8)
    a.set_xlabel("turns per response")
    a.set_ylabel("responses")
    b.hist(lengths, bins=min(30, max(1, len(set(lengths)))))
    b.set_xlabel("response tokens")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
