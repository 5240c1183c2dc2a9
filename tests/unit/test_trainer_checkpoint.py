"""DCP checkpoints: exact resume (weights, Adam state, RNG, step), keep-last-K, incomplete saves."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from services.trainer.step import StepSettings, train_step
from tests.integration.test_trainer_fsdp import make_samples

SETTINGS = StepSettings(mini_batch_size=4, micro_batch_max_tokens=64)


def _fresh() -> tuple[Actor, torch.optim.Optimizer]:
    actor = Actor(tiny_qwen2(seed=9))
    return actor, torch.optim.AdamW(actor.parameters(), lr=1e-3)


def _params(actor: Actor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in actor.named_parameters()}


def test_resume_is_exact(tmp_path):
    samples = make_samples()
    actor, opt = _fresh()
    train_step(actor, opt, samples, SETTINGS)
    save_checkpoint(tmp_path, 7, actor, opt, extra={"dataset_cursor": 123})
    train_step(actor, opt, samples, SETTINGS)
    expected, expected_rand = _params(actor), torch.rand(3)

    actor2, opt2 = _fresh()  # different state until loaded: it has not trained
    meta = load_checkpoint(latest_checkpoint(tmp_path).path, actor2, opt2)
    assert meta.step == 7 and meta.extra == {"dataset_cursor": 123}
    train_step(actor2, opt2, samples, SETTINGS)
    for name, value in _params(actor2).items():
        torch.testing.assert_close(value, expected[name], atol=1e-7, rtol=0, msg=name)
    torch.testing.assert_close(torch.rand(3), expected_rand)  # RNG restored too


def test_keep_last_k_and_incomplete_saves_ignored(tmp_path):
    actor, opt = _fresh()
    train_step(actor, opt, make_samples(), replace(SETTINGS, mini_batch_size=8))
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, actor, opt, keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]
    (tmp_path / ".tmp-step_00000004" / "state").mkdir(parents=True)  # a crash mid-save
    (tmp_path / "step_00000005").mkdir()  # no meta.json: never completed
    assert latest_checkpoint(tmp_path).step == 3
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        load_checkpoint(tmp_path / "step_00000005", actor, opt)
    save_checkpoint(tmp_path, 6, actor, opt, keep_last=2)
    assert not (tmp_path / ".tmp-step_00000004").exists()
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 6]


def test_a_resave_cut_between_its_renames_keeps_the_previous_copy(tmp_path):
    actor, opt = _fresh()
    save_checkpoint(tmp_path, 4, actor, opt, keep_last=1)
    # the crash: step_4 already moved aside, the new copy never renamed into place
    (tmp_path / "step_00000004").rename(tmp_path / ".tmp-step_00000004.replaced")
    (tmp_path / ".tmp-step_00000004" / "state").mkdir(parents=True)
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 4 and latest.path.name == ".tmp-step_00000004.replaced"
    assert load_checkpoint(latest.path, *_fresh()).step == 4
    save_checkpoint(tmp_path, 5, actor, opt, keep_last=1)
    assert [c.path.name for c in list_checkpoints(tmp_path)] == ["step_00000005"]


def test_the_fault_hold_leaves_a_half_written_checkpoint_that_is_never_resumed(tmp_path, monkeypatch):
    """The chaos test kills the trainer inside this hold: what it leaves must be ignored."""
    import threading
    import time

    from services.trainer.checkpoint import FAULT_HOLD_FILE

    actor, opt = _fresh()
    save_checkpoint(tmp_path / "ck", 2, actor, opt)
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(FAULT_HOLD_FILE, str(hold))
    saver = threading.Thread(target=save_checkpoint, args=(tmp_path / "ck", 4, actor, opt))
    saver.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "ck" / ".tmp-step_00000004" / "rng" / "rank_0.json").exists():
        assert time.monotonic() < deadline, "the save never reached its hold"
        time.sleep(0.05)
    # held: the state is written, meta.json is not, and the half-written save is not a checkpoint
    assert not (tmp_path / "ck" / ".tmp-step_00000004" / "meta.json").exists()
    assert latest_checkpoint(tmp_path / "ck").step == 2
    hold.unlink()
    saver.join(60)
    assert not saver.is_alive() and latest_checkpoint(tmp_path / "ck").step == 4


class _Payload:
    """What an attacker with write access to the shared checkpoint volume plants: unpickling it
    runs ``marker.write_text`` (any code could run there)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.write_text, (pathlib.Path(self.marker), "pwned"))


def _rng_files(ckpt) -> list[str]:
    return sorted(p.name for p in (ckpt / "rng").iterdir())


def test_rng_states_are_json_and_a_planted_pickle_is_refused_without_running(tmp_path):
    import json

    actor, opt = _fresh()
    ckpt = save_checkpoint(tmp_path, 3, actor, opt)
    assert _rng_files(ckpt) == ["rank_0.json"]
    json.loads((ckpt / "rng" / "rank_0.json").read_text())  # data, not a pickle
    # an older checkpoint's name, with a payload in it: read with weights_only=True, refused
    (ckpt / "rng" / "rank_0.json").unlink()
    marker = tmp_path / "marker"
    torch.save({"torch": torch.get_rng_state(), "numpy": _Payload(marker), "python": None},
               ckpt / "rng" / "rank_0.pt")
    with pytest.raises(ValueError, match=r"rank_0\.pt.*refusing to unpickle"):
        load_checkpoint(ckpt, *_fresh())
    assert not marker.exists()
    # a payload where the JSON belongs is not JSON: refused, nothing run
    (ckpt / "rng" / "rank_0.pt").rename(ckpt / "rng" / "rank_0.json")
    with pytest.raises(ValueError, match=r"rank_0\.json: not a valid RNG state"):
        load_checkpoint(ckpt, *_fresh())
    assert not marker.exists()
    assert load_checkpoint(ckpt, *_fresh(), restore_rng=False).step == 3  # the way past, named


def test_an_older_checkpoints_pickled_rng_state_is_still_restored(tmp_path):
    """Checkpoints written before the JSON format keep resuming exactly (numbers, arrays, tensors
    only: what ``weights_only=True`` with numpy's array reconstruction reads)."""
    import random

    import numpy as np

    actor, opt = _fresh()
    ckpt = save_checkpoint(tmp_path, 5, actor, opt)
    (ckpt / "rng" / "rank_0.json").unlink()
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               ckpt / "rng" / "rank_0.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    load_checkpoint(ckpt, *_fresh())
    torch.testing.assert_close(torch.rand(3), expected[0])
    assert np.random.rand(3).tolist() == expected[1].tolist() and random.random() == expected[2]
