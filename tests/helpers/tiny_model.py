"""A tiny Qwen2 model directory built locally (nothing can be downloaded from a hub here).

``tiny_model_dir(tmp_path_factory)`` builds it once per test session and per seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_BUILT: dict[tuple[str, int], Path] = {}


def tiny_model_dir(tmp_path_factory: Any, size: str = "tiny", seed: int = 0) -> Path:
    from services.rollout.model_init import init_model_dir

    key = (size, seed)
    if key not in _BUILT:
        _BUILT[key] = init_model_dir(tmp_path_factory.mktemp(f"{size}-{seed}"), size, seed)  # type: ignore[arg-type]
    return _BUILT[key]
