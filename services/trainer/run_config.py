"""The trainer's run config (``retool trainer run --config``): the loop, the queue, the weight push,
validation and the links' security.

Invariants: every field is checked when the file is loaded (before anything starts); secrets are
never values here, only file paths or env var names (``services.common.security``); discovery
entries are syntax-checked (``discovery.check_entry``); a collective timeout, when set, leaves room
for the longest legitimate wait of the ranks > 0 (rank 0 collecting a batch, then pushing).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from services.common.config import StrictModel
from services.common.queue import RedisAuth
from services.common.schemas import RolloutSampling
from services.common.security import ClientSecurity, TLSClientFiles
from services.trainer.config import TrainerConfig
from services.trainer.discovery import check_entry
from services.trainer.trackers import TrackingConfig


class RunConfig(StrictModel):
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    dataset: str = Field(..., description="RL parquet from `retool data dapo` (prompt, reward_model columns)")
    redis_url: str = "redis://127.0.0.1:6379/0"
    prompts_stream: str = "retool:prompts"
    groups_stream: str = "retool:groups"
    consumer_group: str = "trainer"
    consumer: str = "trainer-0"
    rollout_targets: list[str] = Field(
        default_factory=list,
        description="gRPC host:port of rollout replicas, or dns:host:port (every replica the name "
        "resolves to, re-resolved on each push)",
    )
    weight_token_env: str = Field("RETOOL_WEIGHT_TOKEN", description="NAME of the env var holding the token")
    weight_token_file: str | None = Field(None, description="file holding the weight-push token (preferred "
                                          "over weight_token_env when set)")
    weight_tls: TLSClientFiles | None = Field(
        None, description="push over TLS, verified with ca_file (and mutual TLS with cert_file/key_file)")
    redis_auth: RedisAuth = Field(default_factory=RedisAuth,
                                  description="ACL user, password and TLS to Redis")
    rollout_security: ClientSecurity = Field(
        default_factory=ClientSecurity, description="token and TLS of the rollout HTTP API (validation)")
    weight_bucket_mb: int = Field(4, ge=1, le=64)
    weight_transport: Literal["grpc", "shm"] = Field(
        "grpc", description="shm: replicas on this machine (same uid) get the weights through shared "
        "memory, committed over gRPC (several times faster than the gRPC stream)"
    )
    weight_delta: Literal["auto", "off"] = Field(
        "auto", description="auto: a gRPC push sends a replica that holds the previous version only the "
        "elements that changed in its serving dtype (full pushes where it cannot apply one, or when "
        "changes are dense); off: always full pushes"
    )
    weight_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype the weights are pushed in; auto: each replica's serving dtype"
    )
    weight_encode_where: Literal["auto", "host", "device"] = Field(
        "auto", description="where a delta push compares the weights with the last pushed ones. device: "
        "on the GPU that holds them (only the changed elements are copied to the host); host: numpy on "
        "the CPU after copying the whole master to the host; auto: device when the trainer runs on CUDA "
        "as one rank (the unsharded master is already on that GPU), else host. Measured on an H200, "
        "131M parameters: 0.15 s device against 0.61 s host, master to served (docs/gpu-check.md)"
    )
    weight_push_wait_s: float | None = Field(
        120.0, gt=0, description="a weight push waits at most this long for a replica (retries included); "
        "replicas still unreachable then are skipped (they get a full push later) unless none took the "
        "push, which fails the step. None: any replica that fails every attempt fails the step"
    )
    max_steps: int | None = Field(
        None, ge=1, description="stop after this many steps (never past the data: see planned_steps)"
    )
    sampling: RolloutSampling = Field(default_factory=RolloutSampling)
    max_turns: int | None = Field(None, ge=0)
    incorrect_reward: float = Field(
        -1.0, description="reward of a trajectory the reward service did not score"
    )
    metrics_path: str = "runs/trainer/metrics.jsonl"
    groups_log: str | None = Field(None, description="JSONL of the job ids each step trained on (audit)")
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = Field(
        "127.0.0.1", min_length=1, description="address /metrics and /healthz bind (with metrics_port); "
        "0.0.0.0 in a container that Prometheus scrapes from another one (deploy/ sets it)")
    group_wait_s: float = Field(600.0, gt=0, description="give up when no group arrives for this long")
    reissue_check_s: float = Field(
        30.0, gt=0, description="when no group arrived for this long, look for admitted jobs that are in "
        "no Redis stream (lost with a Redis restart) and push them again")
    val_dataset: str | None = Field(
        None, description="validation parquet (`retool data aime`); None = no validation"
    )
    rollout_urls: list[str] = Field(
        default_factory=list,
        description="rollout HTTP URLs used for validation, or dns:http://host:port (every replica)",
    )
    val_sampling: RolloutSampling = Field(default_factory=lambda: RolloutSampling(temperature=1.0, top_p=0.6))
    val_concurrency: int = Field(8, ge=1, description="validation prompts in flight")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="optional TensorBoard / Weights & Biases logging"
    )

    @field_validator("rollout_targets", "rollout_urls")
    @classmethod
    def _entries(cls, entries: list[str], info: ValidationInfo) -> list[str]:
        return [check_entry(e, url=info.field_name == "rollout_urls") for e in entries]

    @model_validator(mode="after")
    def _collective_timeout(self) -> RunConfig:
        timeout = self.trainer.fsdp.timeout_s
        longest = self.group_wait_s + (self.weight_push_wait_s or 0.0)
        if timeout is not None and timeout <= longest:
            raise ValueError(
                f"trainer.fsdp.timeout_s={timeout:g} must exceed group_wait_s + weight_push_wait_s = "
                f"{longest:g}: ranks > 0 wait in a collective while rank 0 collects a batch and pushes")
        return self

