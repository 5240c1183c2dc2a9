"""``services/common/cli_config.py``: the config / ``--set`` / ``--dry-run`` opening of the service CLIs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.cli_config import resolve_config
from services.common.config import ConfigError, StrictModel


class Probe(StrictModel):
    host: str = "127.0.0.1"
    port: int = 1
    workers: int = 1


def test_file_env_values_then_set_in_that_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("port: 2\nworkers: 2\nhost: file\n")
    monkeypatch.setenv("RETOOL_PROBE__WORKERS", "3")
    cfg = resolve_config(Probe, config=file, env_prefix="RETOOL_PROBE", overrides=["port=5"],
                         values={"host": "option", "port": 4})
    assert cfg == Probe(host="option", port=5, workers=3)


def test_dry_run_prints_the_resolved_config_and_returns_none(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = resolve_config(Probe, config=None, env_prefix="RETOOL_PROBE", overrides=["port=7"], dry_run=True)
    assert cfg is None
    assert json.loads(capsys.readouterr().out) == {"host": "127.0.0.1", "port": 7, "workers": 1}


def test_check_runs_before_dry_run_and_bad_keys_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    def check(cfg: Probe) -> None:
        if cfg.workers > 2:
            raise ConfigError(f"workers: {cfg.workers} > 2")

    with pytest.raises(ConfigError, match="workers: 3 > 2"):
        resolve_config(Probe, config=None, env_prefix="RETOOL_PROBE", overrides=["workers=3"], dry_run=True,
                       check=check)
    assert capsys.readouterr().out == ""  # nothing printed for a config that fails its check
    with pytest.raises(ConfigError, match="portt"):
        resolve_config(Probe, config=None, env_prefix="RETOOL_PROBE", overrides=["portt=1"])
