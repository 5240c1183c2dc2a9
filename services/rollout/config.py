"""Rollout service configuration (one validated model; env prefix ``RETOOL_ROLLOUT``).

Invariant: the weight-push token is never a config value that could come from a command
line; only the *name* of an environment variable or the *path* of a file that holds it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from services.chat.format import ChatFormat
from services.common.config import StrictModel
from services.common.queue import RedisAuth
from services.common.security import ClientSecurity, ServerSecurity, TLSServerFiles, read_secret


class AgentConfig(ChatFormat):
    """The multi-turn tool loop (see services/rollout/agent/loop.py for the exact semantics); the
    token layout it shares with SFT is the ``ChatFormat`` part."""

    max_turns: int = Field(8, ge=0, description="tool calls per response; one more request ends it")
    max_response_tokens: int = Field(16384, ge=1, description="generated + interpreter tokens")
    stop_at_answer: bool = Field(True, description="end the response when </answer> is generated")
    tool_session: Literal["stateless", "persistent"] = Field("stateless", description=(
        "stateless: each tool call runs alone (the ReTool recipe); persistent: one live sandbox "
        "session per trajectory (opened at its first tool call, closed when it ends), so later "
        "calls see earlier calls' variables"))
    sandbox_run_timeout_s: float = Field(10.0, gt=0, description="run_timeout sent to /run_code")
    sandbox_memory_mb: int = Field(1024, ge=16)
    sandbox_request_timeout_s: float = Field(60.0, gt=0, description=(
        "time budget of one tool call (/run_code or /sessions), retries and their pauses included"))
    sandbox_retries: int = Field(8, ge=0, description=(
        "retries on connection errors, 429 and 5xx (8: about 20 s of pauses, enough for a sandbox restart)"))
    sandbox_retry_backoff_s: float = Field(0.2, ge=0, description=(
        "first pause between retries (doubling, plus jitter; a Retry-After answer sets it)"))
    allow_degraded_sandbox: bool = Field(False, description=(
        "use a sandbox that runs with isolation: degraded (it says so in /healthz and in the "
        "X-Sandbox-Isolation header of every answer). false: the rollout refuses to start against "
        "one and fails every tool call it answers; true: it is used, counted in "
        "rollout_sandbox_degraded_answers_total and logged as an error at start"))
    reward_timeout_s: float = Field(60.0, gt=0, description=(
        "time budget of one grade: connection errors, 429 and 5xx (503 overload: after its "
        "Retry-After) are retried until it is spent"))
    include_text: bool = Field(True, description="put the decoded response text in each trajectory")


class RedisWorkerConfig(StrictModel):
    url: str | None = Field(None, description="redis://host:port/db; unset = no queue worker")
    auth: RedisAuth = Field(default_factory=RedisAuth, description="ACL user, password and TLS")
    prompts_stream: str = "retool:prompts"
    groups_stream: str = "retool:groups"
    group: str = Field("rollout", description="consumer group of the prompts stream")
    consumer: str | None = Field(None, description="consumer name; default hostname-pid")
    concurrency: int = Field(4, ge=1, description="prompt jobs processed at once by this replica")
    block_ms: int = Field(1000, ge=1, le=20_000, description=(
        "longest blocking read; below the Redis client's socket timeout (services/common/queue.py)"))
    claim_idle_ms: int = Field(60_000, ge=100, description="re-claim jobs idle this long (crashed consumer)")
    heartbeat_ms: int = Field(10_000, ge=50, description="how often in-progress jobs are touched")
    drain_s: float = Field(30.0, ge=0, description="on shutdown, time given to running jobs to finish")
    groups_maxlen: int | None = Field(None, ge=1, description="approximate cap of the groups stream")
    max_deliveries: int = Field(
        5, ge=1, description="a job delivered more often goes to the dead-letter stream"
    )
    checkpoints: bool = Field(True, description=(
        "write each sample's state to Redis at every turn boundary, so that a re-claimed or handed-back "
        "job continues its samples instead of restarting them (services/rollout/agent/checkpoint.py)"))
    checkpoint_ttl_s: int = Field(3600, ge=1, description=(
        "a job's checkpoints expire this long after their last write (an abandoned job's state)"))
    checkpoint_max_staleness: int = Field(1, ge=0, description=(
        "a checkpoint whose oldest generated token is more policy versions behind the engine's "
        "weights is discarded and the sample restarts; keep it equal to the trainer's max_staleness"))

    @model_validator(mode="after")
    def _heartbeat(self) -> RedisWorkerConfig:
        if self.heartbeat_ms >= self.claim_idle_ms:
            raise ValueError(
                f"heartbeat_ms ({self.heartbeat_ms}) must be below claim_idle_ms "
                f"({self.claim_idle_ms}) or live jobs get re-claimed"
            )
        return self


class RolloutConfig(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int | None = Field(None, ge=0, le=65535, description="weight-push gRPC port; unset = off")
    log_level: str = "INFO"
    model: str | None = Field(None, description="model directory (weights + tokenizer)")
    engine: Literal["hf", "vllm", "synthetic"] = Field("hf", description=(
        "hf: transformers; vllm; synthetic: scripted ReTool turns at a modelled GPU speed, no model "
        "(benchmarks of the services around the engine, docs/scale.md)"))
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="engine settings: HFEngine options for hf, vLLM AsyncEngineArgs fields for vllm, "
        "SyntheticEngineConfig fields for synthetic "
        "(e.g. --set engine_kwargs.tensor_parallel_size=4); unknown keys are a config error",
    )
    sandbox_url: str = "http://127.0.0.1:8080"
    reward_url: str | None = Field(None, description="reward service; unset = trajectories unscored")
    weight_token_env: str | None = Field("RETOOL_WEIGHT_TOKEN", description="env var holding the token")
    weight_token_file: str | None = Field(None, description="file holding the weight-push token")
    weight_tls: TLSServerFiles | None = Field(None, description="serve the weight push over TLS only "
                                              "(mutual TLS with client_ca_file)")
    security: ServerSecurity = Field(default_factory=ServerSecurity, description=(
        "bearer token (and optional HTTPS) for every HTTP route (/v1/rollouts, /v1/chat/completions, "
        "...) but /healthz and /metrics"))
    sandbox_security: ClientSecurity = Field(default_factory=ClientSecurity,
                                             description="token and TLS to reach the sandbox")
    reward_security: ClientSecurity = Field(default_factory=ClientSecurity,
                                            description="token and TLS to reach the reward service")
    max_n: int = Field(64, ge=1, description="largest n accepted per request")
    max_prompt_tokens: int = Field(4096, ge=1, description="longer prompts are refused (422 / dead letter)")
    max_concurrent_requests: int = Field(64, ge=1)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    redis: RedisWorkerConfig = Field(default_factory=RedisWorkerConfig)


def read_weight_token(cfg: RolloutConfig) -> str | None:
    """The weight-push token from the file or env var named in the config (never logged)."""
    return read_secret(cfg.weight_token_file, cfg.weight_token_env, "weight_token_file")
