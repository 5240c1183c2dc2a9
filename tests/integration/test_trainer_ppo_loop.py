"""``retool trainer run`` with ``algorithm: ppo``: critic warm-up, critic metrics, the critic in the
checkpoint and an exact-step resume — a real process on real Redis streams and a real weight push
(the scripted rollout side and the replica come from tests/integration/test_trainer_loop.py)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.integration.test_trainer_loop import _config, _run_trainer, replica  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration


def _ppo_config(tmp_path, replica, redis_url, max_steps):  # noqa: F811
    path = _config(tmp_path, replica["model"], redis_url, replica["target"], max_steps)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"].update(
        algorithm="ppo", group_size=1, batch_prompts=4, dynamic_sampling={"enabled": False},
        critic={"lr": 1e-3, "lam": 0.95, "warmup_steps": 1},
    )
    path.write_text(yaml.safe_dump(cfg))
    return path


async def test_ppo_run_trains_the_critic_checkpoints_it_and_resumes(tmp_path, redis_server, replica):  # noqa: F811
    rc, out = await _run_trainer(_ppo_config(tmp_path, replica, redis_server.url, 2))
    assert rc == 0, out
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["critic/optimizer_steps"] == 1 and m["critic/vf_loss"] > 0 for m in lines)
    assert "actor/pg_loss" not in lines[0] and "actor/pg_loss" in lines[1]  # warm-up: critic only
    meta = json.loads((tmp_path / "ckpt" / "step_00000002" / "meta.json").read_text())
    assert meta["components"] == ["critic"]

    rc, out = await _run_trainer(_ppo_config(tmp_path, replica, redis_server.url, 3))
    assert rc == 0, out
    assert "resumed from" in out
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert "actor/pg_loss" in lines[2] and replica["engine"].version == 3
