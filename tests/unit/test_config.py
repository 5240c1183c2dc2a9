from pathlib import Path

import pytest
from pydantic import Field

from services.common.config import ConfigError, StrictModel, load_config


class Inner(StrictModel):
    size: int = Field(4, ge=1)
    name: str = "x"


class Cfg(StrictModel):
    port: int = Field(8000, ge=0, le=65535)
    ratio: float = 0.5
    inner: Inner = Inner()
    tags: list[str] = []


def test_defaults_when_nothing_given():
    cfg = load_config(Cfg, environ={})
    assert cfg.port == 8000 and cfg.inner.size == 4


def test_layering_file_then_env_then_cli(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("port: 9000\ninner:\n  size: 7\n  name: file\n")
    env = {"RETOOL_T__PORT": "9100", "RETOOL_T__INNER__NAME": "env", "OTHER": "1"}
    cfg = load_config(Cfg, file=f, env_prefix="RETOOL_T", environ=env, overrides=["inner.size=9"])
    assert cfg.port == 9100            # env beats file
    assert cfg.inner.name == "env"     # env beats file, nested
    assert cfg.inner.size == 9         # CLI beats file
    cfg2 = load_config(Cfg, file=f, env_prefix="RETOOL_T", environ=env, overrides=["port=1"])
    assert cfg2.port == 1              # CLI beats env


def test_cli_values_are_yaml_scalars():
    cfg = load_config(Cfg, environ={}, overrides=["tags=[a, b]", "ratio=0.25"])
    assert cfg.tags == ["a", "b"] and cfg.ratio == 0.25


def test_json_file(tmp_path: Path):
    f = tmp_path / "c.json"
    f.write_text('{"port": 1234}')
    assert load_config(Cfg, file=f).port == 1234


def test_invalid_value_names_the_field():
    with pytest.raises(ConfigError) as err:
        load_config(Cfg, environ={}, overrides=["inner.size=0", "port=70000"])
    msg = str(err.value)
    assert "inner.size" in msg and "port" in msg


def test_unknown_key_is_an_error(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("prot: 1\n")
    with pytest.raises(ConfigError, match="prot"):
        load_config(Cfg, file=f)


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="not found"):
        load_config(Cfg, file="/nonexistent/x.yaml")
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(Cfg, overrides=["portonly"])


def test_sandbox_config_cross_field_check():
    from services.sandbox.config import SandboxConfig

    with pytest.raises(ConfigError, match="default_memory_mb"):
        load_config(SandboxConfig, environ={}, overrides=["default_memory_mb=8192", "max_memory_mb=4096"])
    assert load_config(SandboxConfig, environ={}).max_concurrency == 128
    assert load_config(SandboxConfig, environ={}).default_memory_mb == 1024


# The three behaviours pydantic-settings 2.16 does not have (why common/config.py stays ours,
# docs/configuration.md): a typo in an env name, YAML values in env, a missing file.
def test_a_typo_in_an_env_name_is_an_error():
    with pytest.raises(ConfigError, match="prot"):
        load_config(Cfg, env_prefix="RETOOL_T", environ={"RETOOL_T__PROT": "1"})


def test_env_values_are_yaml_and_errors_name_the_field():
    assert load_config(Cfg, env_prefix="RETOOL_T", environ={"RETOOL_T__TAGS": "[a, b]"}).tags == ["a", "b"]
    with pytest.raises(ConfigError, match="inner.size"):
        load_config(Cfg, env_prefix="RETOOL_T", environ={"RETOOL_T__INNER__SIZE": "0"})


@pytest.mark.parametrize("service", ["sandbox", "reward", "rollout"])
def test_serve_dry_run_prints_the_resolved_config_and_starts_nothing(service, tmp_path: Path):
    import json

    from typer.testing import CliRunner

    from services.cli import app

    f = tmp_path / "c.yaml"
    f.write_text("port: 7000\nlog_level: WARNING\n")
    env = {f"RETOOL_{service.upper()}__PORT": "7100"}
    args = [service, "serve", "--config", str(f), "--set", "log_level=DEBUG", "--dry-run"]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    cfg = json.loads(result.output)
    assert (cfg["port"], cfg["log_level"]) == (7100, "DEBUG")  # env beats file, --set beats both
    bad = CliRunner().invoke(app, [service, "serve", "--set", "port=70000", "--dry-run"], env={})
    assert isinstance(bad.exception, ConfigError) and "port" in str(bad.exception)
