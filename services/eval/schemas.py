"""What an evaluation is asked (``EvalConfig``) and what it writes (``EvalReport``, ``report.json``).

Invariant: ``run.py`` produces an ``EvalReport`` and ``report.py`` renders one; both import it from
here, so neither imports the other.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from services.common.config import StrictModel
from services.eval.metrics import EvalSummary


class EvalConfig(StrictModel):
    data: str = Field(description="parquet with prompt / reward_model.ground_truth / data_source columns")
    model: str | None = Field(None, description="HF model directory served by a local rollout service")
    rollout_urls: list[str] = Field(default_factory=list,
                                    description="running rollout replicas; empty = start one locally")
    n: int = Field(30, ge=1, le=1024, description="responses per prompt")
    limit: int | None = Field(None, ge=1, description="evaluate only the first LIMIT prompts")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(0.6, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, description="response budget; unset = the service's default")
    max_turns: int | None = Field(None, ge=0, description="tool calls per response; unset = the service's")
    seed: int | None = 0
    concurrency: int = Field(16, ge=1, description="prompts in flight")
    n_bootstrap: int = Field(1000, ge=1)
    out_dir: str = "runs/eval"
    rollout_args: list[str] = Field(default_factory=list,
                                    description="extra `retool rollout serve` args (local service)")
    startup_timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _where(self) -> EvalConfig:
        if not self.rollout_urls and not self.model:
            raise ValueError("give either 'model' (a local rollout service is started) or 'rollout_urls'")
        if self.rollout_urls and self.model:
            raise ValueError("give 'model' or 'rollout_urls', not both (a running service has its own model)")
        if not Path(self.data).is_file():
            raise ValueError(f"data: file {self.data} does not exist")
        if self.model and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model} is not a Hugging Face model directory (no config.json)")
        return self


class EvalReport(StrictModel):
    config: EvalConfig
    summary: EvalSummary
    metrics: dict[str, float] = Field(description="reference names: val-core/<source>/acc/mean@N, …")
    wall_seconds: float
