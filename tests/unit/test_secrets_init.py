"""``retool secrets init``'s file modes (issue 33, 5d): no secret is readable by others on the host,
even once copied out of its 0700 directory; the containers read theirs through the group."""

from __future__ import annotations

import os
import stat

import pytest
from typer.testing import CliRunner

pytest.importorskip("cryptography")  # the deploy extra; the dev extra has it

from services.stack.secrets import init_secrets  # noqa: E402
from services.stack.secrets_cli import app  # noqa: E402


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_private_keys_tokens_and_passwords_are_never_world_readable(tmp_path):
    out = tmp_path / "secrets"
    names = init_secrets(out)
    assert _mode(out) == 0o700
    modes = {name: _mode(out / name) for name in names}
    assert modes["ca.key"] == 0o600
    for name in ("redis.key", "rollout.key", "sandbox.key", "reward.key", "trainer.key", "weight-token",
                 "rollout-token", "sandbox-token", "reward-token", "redis-trainer-password",
                 "redis-rollout-password", "redis-health-password", "redis-users.acl",
                 "grafana-admin-password"):
        assert modes.pop(name) == 0o640, name
    modes.pop("ca.key")
    # what is left holds no secret: certificates and token digests
    assert modes and all(n.endswith((".crt", ".sha256")) and m == 0o644 for n, m in modes.items()), modes
    assert {(out / n).stat().st_gid for n in names} == {(out / "ca.crt").stat().st_gid}


def test_the_group_is_the_one_asked_for_and_the_cli_names_it(tmp_path):
    group = os.getgroups()[-1] if os.getgroups() else os.getgid()
    out = tmp_path / "secrets"
    result = CliRunner().invoke(app, ["--out", str(out), "--group", str(group)])  # `retool secrets init`
    assert result.exit_code == 0, result.output
    assert f"RETOOL_SECRETS_GID={group}" in result.output
    assert (out / "rollout.key").stat().st_gid == group and _mode(out / "rollout.key") == 0o640
    assert "BEGIN" not in result.output  # names only, never a value
