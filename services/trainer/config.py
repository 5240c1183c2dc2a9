"""Trainer configuration (one validated model; env prefix ``RETOOL_TRAINER``).

Invariants: impossible combinations are rejected when the model is built (ConfigError via
load_config), and ``validate_parallel(world_size)`` rejects parallel sizes that do not fit the
world size *before* any process group, mesh or model exists, naming the setting and the numbers.
Defaults are the reference ReTool/DAPO run (32 prompts × 16 responses, mini-batch 64, lr 1e-6,
clip 0.2/0.28, token-mean, validate every 5 steps, checkpoint every 30).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import ConfigError, StrictModel


class DynamicSamplingConfig(StrictModel):
    enabled: bool = True
    max_groups_pulled: int | None = Field(None, ge=1, description="give up after this many groups "
                                          "without filling the batch; None = no limit")


class OverlongConfig(StrictModel):
    enabled: bool = False
    buffer_len: int = Field(4096, ge=1)
    penalty_factor: float = Field(1.0, ge=0)


class TISConfig(StrictModel):
    enabled: bool = False
    cap: float = Field(2.0, gt=0, description="C in min(exp(old_logp - rollout_logp), C)")


class MISConfig(StrictModel):
    """Sequence-level masked importance sampling: drop a sequence whose rollout→trainer ratio
    exp(Σ old_logp - rollout_logp) over its policy tokens leaves [1/cap, cap]."""

    enabled: bool = False
    cap: float = Field(2.0, gt=1, description="C: sequences with ratio outside [1/C, C] are dropped")


class KLConfig(StrictModel):
    use_kl_loss: bool = False
    coef: float = Field(0.0, ge=0)
    kind: Literal["k1", "k2", "k3"] = "k3"


class FSDPConfig(StrictModel):
    dp_size: int | None = Field(None, ge=1, description="data-parallel size; None = world / sp_size")
    sp_size: int = Field(1, ge=1, description="sequence-parallel (Ulysses) size")
    cpu_offload: bool = False
    param_dtype: Literal["bf16", "fp32"] = "bf16"
    reduce_dtype: Literal["bf16", "fp32"] = "fp32"
    gradient_checkpointing: bool = True
    reshard_after_forward: bool = True
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float | None = Field(
        None, gt=0, description="collective timeout: a rank that waits longer for its peers (e.g. a dead "
        "node) fails the step instead of hanging; None = torch's default (NCCL 10 min, gloo 30 min)")


class CriticConfig(StrictModel):
    """The value model and GAE of ``algorithm: ppo`` (defaults: verl's critic / GAE defaults)."""

    model_path: str | None = Field(None, description="backbone of the value model; None = trainer.model_path")
    lr: float = Field(1e-5, gt=0)
    cliprange_value: float = Field(0.5, gt=0, description="clip of v - v_old in the value loss")
    vf_coef: float = Field(1.0, gt=0, description="value-loss coefficient")
    grad_clip: float = Field(1.0, gt=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    whiten_advantages: bool = Field(True, description="normalise GAE advantages over the batch's policy "
                                    "tokens")
    warmup_steps: int = Field(0, ge=0, description="first steps train only the critic (actor not updated)")


class TrainerConfig(StrictModel):
    algorithm: Literal["grpo", "ppo"] = "grpo"
    step_mode: Literal["train", "null"] = Field("train", description=(
        "null (benchmarks only, bench/scale.py): the whole feed runs (read, decode, validate, dedupe, "
        "staleness, ledger, packing into tensors) and a push of null_push_mb travels the real weight "
        "path, but forward and backward are skipped: the policy never changes. Every metrics line "
        "carries step_mode=null"))
    null_push_mb: float | None = Field(None, gt=0, description=(
        "step_mode=null: push a synthetic weight set of this size (what an engine: synthetic replica "
        "with engine_kwargs.payload_mb serves) instead of the model's weights"))
    model_path: str | None = None
    batch_prompts: int = Field(32, ge=1, description="prompts (groups) per training step")
    group_size: int = Field(16, ge=1, description="responses per prompt")
    mini_batch_size: int = Field(64, ge=1, description="responses per optimizer step")
    micro_batch_max_tokens: int = Field(18432, ge=16, description="token budget of one packed micro-batch")
    use_packing: bool = True
    feed_overlap: bool = Field(True, description=(
        "read, decode, validate, dedupe and judge the staleness of step N+1's groups on rank 0 while "
        "step N's update runs (in a worker thread): the feed leaves the critical path. The batches "
        "are the ones the sequential loop takes (staleness judged at the version they train at), "
        "never acknowledged before they are trained (services/trainer/prefetch.py); false: the "
        "sequential loop (read after the update)"))
    padded_micro_batch_size: int | None = Field(None, ge=1, description="with use_packing=false: "
                                                "sequences per padded micro-batch (None = token budget)")
    logprob_chunk_tokens: int = Field(4096, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    recompute_old_logprobs: bool = True
    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    clip_ratio_high: float = Field(0.28, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    norm_adv_by_std: bool = True
    entropy_coeff: float = Field(0.0, ge=0)
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    temperature: float = Field(1.0, gt=0)
    max_prompt_len: int = Field(2048, ge=1)
    max_response_len: int = Field(16384, ge=1)
    max_staleness: int = Field(1, ge=0, description="policy versions a group may lag the trainer")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    tis: TISConfig = Field(default_factory=TISConfig)
    mis: MISConfig = Field(default_factory=MISConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig, description="algorithm: ppo only")
    total_epochs: int = Field(1, ge=1)
    save_freq: int = Field(30, ge=1)
    test_freq: int = Field(5, ge=1)
    val_before_train: bool = True
    val_n: int = Field(30, ge=1)
    keep_last_checkpoints: int = Field(2, ge=1)
    checkpoint_dir: str = "checkpoints"
    seed: int = 42

    @property
    def train_batch_responses(self) -> int:
        return self.batch_prompts * self.group_size

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        total = self.train_batch_responses
        if self.mini_batch_size > total:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) exceeds batch_prompts × group_size "
                             f"({self.batch_prompts} × {self.group_size} = {total})")
        if total % self.mini_batch_size:
            raise ValueError(f"batch_prompts × group_size ({total}) must be a multiple of mini_batch_size "
                             f"({self.mini_batch_size})")
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ValueError("group_size must be >= 2 for grpo (advantages are relative within a group)")
        if self.algorithm != "ppo" and self.critic != CriticConfig():  # defaults (a dumped config) pass
            raise ValueError(f"critic settings differ from the defaults but algorithm={self.algorithm!r}: "
                             "only algorithm=ppo trains a critic")
        if self.group_size < 2 and self.dynamic_sampling.enabled:
            raise ValueError("dynamic_sampling.enabled drops groups whose rewards are all equal, which "
                             "every group of group_size=1 is; set dynamic_sampling.enabled=false or "
                             "group_size >= 2")
        if self.micro_batch_max_tokens < self.max_prompt_len + self.max_response_len and self.use_packing:
            raise ValueError(f"micro_batch_max_tokens ({self.micro_batch_max_tokens}) must hold one full "
                             f"sequence: max_prompt_len + max_response_len = "
                             f"{self.max_prompt_len + self.max_response_len}")
        if self.overlong.enabled and self.overlong.buffer_len > self.max_response_len:
            raise ValueError(f"overlong.buffer_len ({self.overlong.buffer_len}) exceeds max_response_len "
                             f"({self.max_response_len})")
        if self.step_mode == "null" and self.algorithm != "grpo":
            raise ValueError("step_mode=null: only algorithm=grpo (the null step has no critic pass)")
        if self.null_push_mb is not None and self.step_mode != "null":
            raise ValueError("null_push_mb is set but step_mode is not null")
        if self.kl.use_kl_loss and self.kl.coef == 0:
            raise ValueError("kl.use_kl_loss is on but kl.coef is 0")
        return self

    def validate_parallel(self, world_size: int) -> tuple[int, int]:
        """Check sizes against the world before anything starts; returns (dp_size, sp_size)."""
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {world_size}")
        sp = self.fsdp.sp_size
        if sp > world_size:
            raise ConfigError(f"fsdp.sp_size (sequence_parallel_size)={sp} but world size is {world_size}: "
                              f"sequence parallelism cannot span more processes than exist; use sp_size <= "
                              f"{world_size}")
        if world_size % sp:
            raise ConfigError(f"fsdp.sp_size={sp} does not divide world size {world_size}")
        dp = self.fsdp.dp_size if self.fsdp.dp_size is not None else world_size // sp
        if dp * sp != world_size:
            raise ConfigError(f"fsdp.dp_size × fsdp.sp_size = {dp} × {sp} = {dp * sp} but world size is "
                              f"{world_size}")
        if self.mini_batch_size % dp:
            raise ConfigError(f"mini_batch_size={self.mini_batch_size} is not divisible by data-parallel "
                              f"size {dp} (world {world_size} / sp {sp})")
        if sp > 1:
            raise ConfigError(f"fsdp.sp_size={sp}: sequence parallelism is not implemented yet; "
                              "use sp_size=1")
        return dp, sp
