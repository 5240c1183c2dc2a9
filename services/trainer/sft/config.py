"""SFT configuration (one validated model; env prefix ``RETOOL_SFT``).

Invariants: everything that can be checked before a process group or a model exists is checked
when the model is built (ConfigError via load_config) or by ``validate_parallel(world_size)``;
the tool-result template and tool-output truncation are a ``services.chat`` ``ChatFormat``, the part
of the rollout's ``AgentConfig`` that decides tokens, so the trained layout is the one the rollout
agent loop produces. Defaults are the reference ReTool SFT
run (max length 16384, batch 32, micro-batch 4, lr 1e-5, weight decay 0.01, 6 epochs).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.chat.format import ChatFormat
from services.common.config import ConfigError, StrictModel
from services.trainer.config import FSDPConfig, TrainerConfig


class SFTDataConfig(StrictModel):
    train_files: list[str] = Field(default_factory=list,
                                   description="parquet/jsonl written by `retool data retool-sft`")
    messages_key: str = Field("messages", min_length=1)
    render: Literal["inline", "chat_template"] = Field(
        "inline", description="inline: the rollout agent loop's layout (one assistant response, tool "
        "results inserted via agent.result_template); chat_template: tool turns as chat messages")
    max_length: int = Field(16384, ge=2, description="tokens per sample (prompt + response)")
    truncation: Literal["drop", "truncate", "error"] = Field(
        "drop", description="samples longer than max_length: drop them, cut them at max_length, or fail")
    append_eos: bool = Field(True, description="inline: end the response with the tokenizer's EOS (loss 1)")
    limit: int | None = Field(None, ge=1, description="use only the first N rows")


class SFTOptimConfig(StrictModel):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = Field(0.1, ge=0, lt=1, description="linear warm-up over this share of the steps")
    warmup_steps: int | None = Field(None, ge=0, description="overrides warmup_ratio when set")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine decays to lr × min_lr_ratio")
    grad_clip: float = Field(1.0, gt=0)


class SFTCheckpointConfig(StrictModel):
    dir: str = "runs/sft/checkpoints"
    save_freq: int = Field(100, ge=1, description="optimizer steps between checkpoints (and one at the end)")
    keep_last: int = Field(2, ge=1)
    resume: Literal["auto", "never"] = Field("auto", description="auto: continue from the latest in dir")
    resume_from: str | None = Field(None, description="a step_XXXXXXXX directory; overrides resume")


class SFTConfig(StrictModel):
    model_path: str | None = Field(None, description="Hugging Face model directory to start from")
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    agent: ChatFormat = Field(default_factory=ChatFormat, description="tool format + result template")
    optim: SFTOptimConfig = Field(default_factory=SFTOptimConfig)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    checkpoint: SFTCheckpointConfig = Field(default_factory=SFTCheckpointConfig)
    epochs: int = Field(6, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    batch_size: int = Field(32, ge=1, description="sequences per optimizer step (global)")
    micro_batch_size: int = Field(4, ge=1, description="sequences per micro-batch per rank; the packed "
                                  "token budget is micro_batch_size × max_length unless set below")
    micro_batch_max_tokens: int | None = Field(None, ge=2, description="packed micro-batch token budget")
    logprob_chunk_tokens: int = Field(4096, ge=1)
    shuffle: bool = True
    seed: int = 42
    output_dir: str = Field("runs/sft/hf", description="exported Hugging Face model (weights + tokenizer)")
    metrics_path: str = "runs/sft/metrics.jsonl"
    progress: bool = True

    @property
    def token_budget(self) -> int:
        if self.micro_batch_max_tokens is not None:
            return self.micro_batch_max_tokens
        return self.micro_batch_size * self.data.max_length

    @model_validator(mode="after")
    def _consistent(self) -> SFTConfig:
        if self.token_budget < self.data.max_length:
            raise ValueError(f"micro_batch_max_tokens ({self.token_budget}) must hold one full sample: "
                             f"data.max_length = {self.data.max_length}")
        if self.fsdp.cpu_offload:
            raise ValueError("fsdp.cpu_offload is not supported by SFT yet")
        return self

    def require_ready(self) -> None:
        """Fields that may be filled late (CLI overrides) but must exist before a run starts."""
        if not self.model_path:
            raise ConfigError("model_path: a Hugging Face model directory is required")
        if not self.data.train_files:
            raise ConfigError("data.train_files: at least one parquet/jsonl file is required")

    def trainer_view(self) -> TrainerConfig:
        """The trainer settings the shared FSDP helpers read (fsdp, optimizer, one mini-batch)."""
        return TrainerConfig.model_construct(
            fsdp=self.fsdp, mini_batch_size=self.batch_size, lr=self.optim.lr,
            weight_decay=self.optim.weight_decay, betas=self.optim.betas, grad_clip=self.optim.grad_clip)

    def validate_parallel(self, world_size: int) -> tuple[int, int]:
        try:
            return self.trainer_view().validate_parallel(world_size)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("mini_batch_size", "batch_size")) from None
