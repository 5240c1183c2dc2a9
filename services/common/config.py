"""Layered configuration: model defaults < file (YAML/JSON) < environment < CLI overrides.

Invariant: a service starts only with a fully validated pydantic model; anything wrong is
reported once, as a ``ConfigError`` naming every offending field by its dotted path.

Kept instead of pydantic-settings (measured: our tests/unit/test_config.py run against a
pydantic-settings 2.16.3 rebuild of ``load_config``, 9 of 12 passed): it keeps the precedence and
the dotted paths, but ignores an env name with a typo (``RETOOL_T__PROT``) although the model
forbids extras, parses env values as JSON (``[a, b]`` fails, with no field path) and skips a
missing config file silently. Fixing those needs a custom env source and a file check: no
smaller than this module (docs/configuration.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """Raised for any invalid configuration; the message says what to fix."""


class StrictModel(BaseModel):
    """Base for config models: unknown keys are errors (typos must not pass silently)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = target
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _parse_scalar(text: str) -> Any:
    """CLI/env values are YAML scalars: ``8`` -> int, ``true`` -> bool, ``[a, b]`` -> list."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {p} is not valid {p.suffix.lstrip('.') or 'YAML'}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must contain a mapping at the top level")
    return data


def env_overrides(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``PREFIX__A__B=v`` -> ``{"a": {"b": v}}`` (double underscore separates levels)."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    marker = prefix.upper() + "__"
    for key, value in environ.items():
        if key.startswith(marker):
            dotted = key[len(marker):].lower().replace("__", ".")
            _set_dotted(out, dotted, _parse_scalar(value))
    return out


def cli_overrides(pairs: Iterable[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} must look like key.path=value")
        key, value = pair.split("=", 1)
        _set_dotted(out, key.strip(), _parse_scalar(value))
    return out


def format_validation_error(exc: ValidationError, source: str = "config") -> str:
    lines = [f"invalid {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"  - {loc}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err and
                                                     not isinstance(err["input"], dict) else ""))
    return "\n".join(lines)


def load_config(
    model: type[M],
    *,
    file: str | Path | None = None,
    env_prefix: str | None = None,
    overrides: Iterable[str] = (),
    values: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> M:
    """Build ``model`` from defaults, then ``file``, env (``env_prefix``), ``values`` and ``overrides``."""
    data: dict[str, Any] = {}
    if file is not None:
        data = _deep_merge(data, read_config_file(file))
    if env_prefix:
        data = _deep_merge(data, env_overrides(env_prefix, environ))
    if values:
        data = _deep_merge(data, {k: v for k, v in values.items() if v is not None})
    data = _deep_merge(data, cli_overrides(overrides))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def dump_config(cfg: BaseModel) -> str:
    """The resolved, validated config as JSON (what ``--dry-run`` prints; never holds a secret:
    secrets are read from the env var or file a config *names*)."""
    return json.dumps(cfg.model_dump(mode="json"), indent=2)
