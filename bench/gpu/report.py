"""The GPU check's report: ``gpu-report.json`` (validated here) and its Markdown rendering.

Invariants:
- every section appears once, in ``SECTIONS`` order, with a status: ``ok``, ``error`` (its message,
  and whatever it measured before failing), ``timeout`` (killed at its budget; what it saved), or
  ``skipped`` (the overall deadline left no time);
- an ``ok`` section's results validate against its model below (the documented format,
  docs/gpu-check.md); a result that does not is turned into an ``error`` naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SECTIONS = ("env", "trainer", "packing", "engine", "weights")
Status = Literal["ok", "error", "timeout", "skipped"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class EnvResult(_Open):
    device: str
    torch: str
    cuda: str | None
    gpu_name: str | None
    gpu_memory_gib: float | None
    nccl_available: bool
    bf16_peak_tflops: float | None
    torch_varlen_attn: bool
    flash_attn: str | None


class ReferenceCheck(_Open):
    pg_loss: float
    grad_norm: float
    pg_loss_abs_diff: float
    grad_norm_rel_diff: float
    passed: bool


class TrainerRun(_Open):
    preset: str
    parameters: int = Field(gt=0)
    tokens_per_step: int = Field(gt=0)
    tokens_per_s: float = Field(gt=0)
    median_step_seconds: float = Field(gt=0)
    mfu: float | None = Field(ge=0, le=1)
    peak_memory_gib: float = Field(gt=0)
    pg_loss: float


class TrainerResult(_Open):
    backend: Literal["nccl", "gloo"]
    world_size: Literal[1]
    reference: dict[str, Any]
    runs: list[TrainerRun] = Field(min_length=1)


class PackingArm(_Open):
    tokens_per_s: float = Field(gt=0)
    vs_padded: float = Field(gt=0)


class PackingResult(_Open):
    real_tokens: int = Field(gt=0)
    default_backend: str
    model: dict[str, PackingArm]
    fastest_packed: str
    attention: dict[str, Any]


class EngineRow(_Open):
    concurrency: int = Field(gt=0)
    tok_s: float = Field(gt=0)


class EngineResult(_Open):
    preset: str
    rows: list[EngineRow] = Field(min_length=1)


class WeightsResult(_Open):
    encode: dict[str, dict[str, Any]]
    encode_payloads_identical: Literal[True]
    push: dict[str, float]
    disk: dict[str, float]
    delta_vs_disk: float = Field(gt=0)
    full_vs_disk: float = Field(gt=0)
    target_met: bool
    faster_encoder: Literal["host", "device"]


MODELS: dict[str, type[BaseModel]] = {
    "env": EnvResult,
    "trainer": TrainerResult,
    "packing": PackingResult,
    "engine": EngineResult,
    "weights": WeightsResult,
}


class SectionReport(BaseModel):
    name: str
    status: Status
    seconds: float
    budget_s: float
    error: str | None = None
    results: dict[str, Any] = Field(default_factory=dict)


class Report(BaseModel):
    schema_version: Literal[1] = 1
    created: str
    device: Literal["cuda", "cpu"]
    command: str
    deadline_s: float
    total_seconds: float
    sections: list[SectionReport]

    def section(self, name: str) -> SectionReport:
        return next(s for s in self.sections if s.name == name)


def validated(section: SectionReport) -> SectionReport:
    """``section`` as is, or as an ``error`` when its ``ok`` results break their documented format."""
    if section.status != "ok":
        return section
    try:
        MODELS[section.name].model_validate(section.results)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return section.model_copy(
            update={"status": "error", "error": f"report format: {where}: {first['msg']}"}
        )
    return section


def _f(x: Any, digits: int = 2) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 10**-digits or x == 0 else f"{x:.2e}"
    return str(x)


def markdown(report: Report) -> str:
    """A human summary: one status table, then the key numbers of each section that ran."""
    lines = [
        f"# GPU check ({report.device}), {report.created}",
        "",
        f"`{report.command}`: {report.total_seconds:.0f} s of {report.deadline_s:.0f} s",
        "",
        "| section | status | seconds | budget s | error |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in report.sections:
        err = (s.error or "").splitlines()[0][:120] if s.error else ""
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.budget_s:.0f} | {err} |")
    env = report.section("env").results
    if env:
        lines += [
            "",
            "## Environment",
            "",
            f"- GPU: {env.get('gpu_name')} ({env.get('gpu_memory_gib')} GiB), driver {env.get('driver')}, "
            f"bf16 peak {env.get('bf16_peak_tflops')} TFLOP/s (measured bf16 GEMM: "
            f"{env.get('matmul_bf16_tflops')})",
            f"- torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL available {env.get('nccl_available')} "
            f"({env.get('nccl_version')}), transformers {env.get('transformers')}, flash-attn "
            f"{env.get('flash_attn')}, torch varlen_attn {env.get('torch_varlen_attn')}",
        ]
    tr = report.section("trainer").results
    if tr.get("runs") or tr.get("reference"):
        lines += [
            "",
            "## Trainer (one rank, FSDP2, bf16 compute)",
            "",
            "| preset | params | tokens/step | tokens/s | MFU | peak GiB | step s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in tr.get("runs", []):
            if "error" in r:
                lines.append(f"| {r['preset']} | {r['error'][:80]} | | | | | |")
                continue
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
            lines.append(
                f"| {r['preset']} | {r['parameters'] / 1e6:.1f}M | {r['tokens_per_step']} | "
                f"{r['tokens_per_s']:.0f} | {mfu} | {r['peak_memory_gib']:.2f} | "
                f"{r['median_step_seconds']:.3f} |"
            )
        ref = tr.get("reference", {})
        for key, val in ref.items():
            if isinstance(val, dict) and "passed" in val:
                lines.append(
                    f"\nreference ({ref.get('preset')}): {key} pg_loss {_f(val['pg_loss'], 5)} vs CPU "
                    f"{_f(ref['cpu_fp32']['pg_loss'], 5)} (|Δ| {_f(val['pg_loss_abs_diff'], 5)}), grad "
                    f"norm rel Δ {_f(val['grad_norm_rel_diff'], 4)}: passed {val['passed']}"
                )
    pk = report.section("packing").results
    if pk.get("model"):
        lines += [
            "",
            f"## Packing ({pk.get('preset')}, {pk.get('real_tokens')} real tokens, {pk.get('dtype')})",
            "",
            "| arm | tokens/s | vs padded |",
            "| --- | --- | --- |",
        ]
        for name, arm in pk["model"].items():
            lines.append(f"| {name} | {arm['tokens_per_s']:.0f} | {arm['vs_padded']:.2f}x |")
    att = pk.get("attention", {})
    if att.get("arms"):
        lines += [
            "",
            f"attention only ({att['tokens']} tokens, {att['sequences']} sequences, {att['dtype']}):",
            "",
            "| backend | fwd+bwd s | vs loop |",
            "| --- | --- | --- |",
        ]
        for name, arm in att["arms"].items():
            if "seconds" in arm:
                lines.append(f"| {name} | {arm['seconds']:.4f} | {arm.get('speedup_vs_loop', 0):.2f}x |")
            else:
                lines.append(f"| {name} | {arm['error'][:90]} | |")
    en = report.section("engine").results
    if en.get("rows"):
        lines += [
            "",
            f"## Engine (HF, {en.get('preset')}, {en.get('dtype')}, {en.get('max_tokens')} tokens "
            "per sequence)",
            "",
            "| concurrent | tok/s |",
            "| --- | --- |",
        ]
        lines += [f"| {r['concurrency']} | {r['tok_s']:.0f} |" for r in en["rows"]]
    wt = report.section("weights").results
    if wt.get("encode"):
        lines += [
            "",
            f"## Weights ({wt.get('preset')}, {wt.get('parameters', 0) / 1e6:.1f}M parameters, "
            f"density {_f(wt.get('density'), 4)})",
            "",
            "| delta encode | median s |",
            "| --- | --- |",
        ]
        lines += [f"| {n} | {a['median_seconds']:.4f} |" for n, a in wt["encode"].items()]
        lines.append(f"| device→host copy of the fp32 master | {wt.get('d2h_fp32_seconds', 0):.4f} |")
    if wt.get("from_master"):
        lines += ["", "| from the master weights to served | seconds |", "| --- | --- |"]
        lines += [f"| {n} | {s:.3f} |" for n, s in wt["from_master"].items()]
        lines.append(
            f"\ndelta vs disk {wt['delta_vs_disk']:.2f}x (target >= {wt['target_vs_disk']}x: "
            f"{wt['target_met']}), full vs disk {wt['full_vs_disk']:.2f}x, faster encoder: "
            f"{wt['faster_encoder']}"
        )
    return "\n".join(lines) + "\n"
