"""The opening every service command shares: ``--config``, ``--set`` and ``--dry-run``.

Invariant: a command's config is resolved in one place, in one order (defaults, the ``--config``
file, ``RETOOL_<SERVICE>__*`` env, the command's own options, then each ``--set``), validated, and
checked by the command's own ``check``; with ``--dry-run`` that resolved config is printed as JSON
(``dump_config``: it never holds a secret) and nothing starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import typer
from pydantic import BaseModel

from services.common.config import dump_config, load_config

M = TypeVar("M", bound=BaseModel)

DRY_RUN_HELP = "print the resolved, validated config and exit"


def config_option(*, required: bool = False, help: str = "YAML/JSON config file") -> Any:
    """``--config/-c``: optional unless ``required``."""
    return typer.Option(... if required else None, "--config", "-c", help=help)


def set_option(example: str) -> Any:
    """``--set KEY=VALUE`` (repeatable), with an example in its help."""
    return typer.Option([], "--set", help=f"override, e.g. --set {example}")


def dry_run_option() -> Any:
    return typer.Option(False, "--dry-run", help=DRY_RUN_HELP)


def resolve_config(model: type[M], *, config: Path | None, env_prefix: str, overrides: list[str],
                   values: Mapping[str, Any] | None = None, dry_run: bool = False,
                   check: Callable[[M], None] | None = None) -> M | None:
    """The validated config, or ``None`` after printing it when ``dry_run`` (the command returns)."""
    cfg = load_config(model, file=config, env_prefix=env_prefix, values=values, overrides=overrides)
    if check is not None:
        check(cfg)
    if dry_run:
        typer.echo(dump_config(cfg))
        return None
    return cfg
