"""Settings of the synthetic engine (``engine: synthetic``), validated before the engine starts.

The timing model of one engine step (every running sequence advances by one token):

    step_s = decode_base_ms/1e3 + decode_per_seq_us/1e6 * running
             + decode_per_kv_token_ns/1e9 * (context tokens of the running sequences)
             + prefill_per_token_us/1e6 * (prompt tokens admitted this step)

``decode_base`` is the weight read of one forward pass, ``decode_per_kv_token`` the KV-cache read of
attention, ``prefill_per_token`` the compute of a prompt token. Presets (derivation and sources in
docs/scale.md): ``h100-7b`` (Qwen2.5-7B, bf16, one H100 SXM), ``h200-32b-tp4`` (Qwen2.5-32B, bf16,
tensor parallel 4 over H200s: one of the two rollout engines of the reference 8xH200 run) and
``infinite`` (no delay: the ceiling of the process around the engine).

Invariant: a bad value is a ``ConfigError`` naming ``engine_kwargs.<field>``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from services.common.config import ConfigError, StrictModel

Preset = Literal["infinite", "h100-7b", "h200-32b-tp4", "custom"]

# (decode_base_ms, decode_per_seq_us, decode_per_kv_token_ns, prefill_per_token_us): see docs/scale.md
PRESETS: dict[str, tuple[float, float, float, float]] = {
    "infinite": (0.0, 0.0, 0.0, 0.0),
    # 15.2 GB of bf16 weights / (3.35 TB/s x 0.7); 57 KB KV per token / 2.35 TB/s; 2 x 7.6 GFLOP / 495 TFLOP/s
    "h100-7b": (6.5, 20.0, 24.0, 31.0),
    # 65.5 GB / (4 x 4.8 TB/s x 0.7); 262 KB KV per token / 13.4 TB/s; 2 x 32.8 GFLOP / (4 x 495 TFLOP/s)
    "h200-32b-tp4": (4.9, 30.0, 20.0, 33.0),
}


class CodeMix(StrictModel):
    """Relative weights of the snippet families (services/rollout/engine/synthetic_script.py)."""

    arithmetic: float = Field(0.35, ge=0)
    itertools: float = Field(0.25, ge=0)
    fractions: float = Field(0.10, ge=0)
    sympy: float = Field(0.30, ge=0)

    @model_validator(mode="after")
    def _some(self) -> CodeMix:
        if self.arithmetic + self.itertools + self.fractions + self.sympy <= 0:
            raise ValueError("at least one snippet family needs a positive weight")
        return self


class SyntheticEngineConfig(StrictModel):
    """``engine_kwargs`` of ``engine: synthetic``."""

    preset: Preset = Field("infinite", description="timing preset; custom: the four timing fields below")
    decode_base_ms: float | None = Field(None, ge=0, description="per step, whatever runs (custom)")
    decode_per_seq_us: float | None = Field(None, ge=0, description="per running sequence per step (custom)")
    decode_per_kv_token_ns: float | None = Field(None, ge=0, description="per KV token per step (custom)")
    prefill_per_token_us: float | None = Field(None, ge=0, description="per admitted prompt token (custom)")
    max_num_seqs: int = Field(256, ge=1, description="running sequences at most (vLLM default); others wait")
    max_model_len: int = Field(32768, ge=16, description="context limit (prompt + response)")
    stream_interval: int = Field(1, ge=1, description="tokens per streamed chunk (vLLM's stream_interval)")
    seed: int = 0
    tool_calls_mean: float = Field(5.0, ge=0, description="code blocks per response, mean (geometric)")
    max_tool_calls: int = Field(8, ge=0, description="the response answers after this many code blocks")
    reasoning_tokens_mean: int = Field(900, ge=1, description="reasoning tokens before a block/answer")
    correct_rate: float = Field(0.5, ge=0, le=1, description="chance that the final answer is right")
    code_mix: CodeMix = Field(default_factory=CodeMix)
    code_cost: int = Field(2000, ge=1, description="snippet loop size (run time scales with it)")
    error_rate: float = Field(0.05, ge=0, le=1, description="chance that a snippet raises (models do)")
    payload_mb: float | None = Field(None, gt=0, description=(
        "serve a synthetic weight set of this size (tensors synthetic.payload.<i>, float32) instead of "
        "the model directory's weights: what a push must carry"))
    stats_path: str | None = Field(None, description="write the engine's counters (JSON) here every second")

    @model_validator(mode="after")
    def _timing(self) -> SyntheticEngineConfig:
        custom = [self.decode_base_ms, self.decode_per_seq_us, self.decode_per_kv_token_ns,
                  self.prefill_per_token_us]
        if self.preset == "custom" and any(v is None for v in custom):
            raise ValueError("preset=custom needs decode_base_ms, decode_per_seq_us, decode_per_kv_token_ns "
                             "and prefill_per_token_us")
        if self.preset != "custom" and any(v is not None for v in custom):
            raise ValueError(f"preset={self.preset} sets the timing itself; use preset=custom to give the "
                             "timing fields")
        return self

    def timing(self) -> tuple[float, float, float, float]:
        """(base s, per sequence s, per context token s, per prefill token s) of one step."""
        if self.preset == "custom":
            base, seq, kv, pre = (float(v or 0.0) for v in (self.decode_base_ms, self.decode_per_seq_us,
                                                             self.decode_per_kv_token_ns,
                                                             self.prefill_per_token_us))
        else:
            base, seq, kv, pre = PRESETS[self.preset]
        return base / 1e3, seq / 1e6, kv / 1e9, pre / 1e6

    @classmethod
    def parse(cls, kwargs: dict[str, Any]) -> SyntheticEngineConfig:
        """The config from ``engine_kwargs``, or a ``ConfigError`` naming each bad field."""
        try:
            return cls.model_validate(kwargs)
        except ValidationError as exc:
            problems = "; ".join(
                f"engine_kwargs.{'.'.join(str(p) for p in e['loc']) or '(engine=synthetic)'}: {e['msg']}"
                for e in exc.errors())
            raise ConfigError(problems) from None


def step_seconds(timing: tuple[float, float, float, float], running: int, context_tokens: int,
                 prefill_tokens: int) -> float:
    base, seq, kv, pre = timing
    if running == 0 and prefill_tokens == 0:
        return 0.0
    return base + seq * running + kv * context_tokens + pre * prefill_tokens
