"""SFT pieces: LR schedule, epoch order, config checks, micro-batch plans and the token-mean loss."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from services.common.config import ConfigError, load_config
from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.sft.config import SFTConfig
from services.trainer.sft.data import batch_indices, epoch_order, steps_per_epoch
from services.trainer.sft.render import Rendered
from services.trainer.sft.run import SFTRunner, plan_local, to_train_sample
from services.trainer.sft.schedule import build_scheduler, lr_factor


def test_warmup_then_cosine() -> None:
    total, warm = 20, 4
    f = [lr_factor(s, total=total, warmup=warm, min_lr_ratio=0.1) for s in range(total)]
    assert all(a < b for a, b in zip(f[:warm], f[1:warm + 1], strict=True))  # linear rise
    assert f[0] > 0 and f[warm] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(f[warm:], f[warm + 1:], strict=False))  # cosine decay
    assert f[-1] > 0.1  # the last step still learns
    mid = warm + (total - warm) // 2
    assert f[mid] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (mid - warm) / (total - warm))))
    assert lr_factor(0, total=1, warmup=0) == 1.0


def test_scheduler_drives_the_optimizer_lr() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2e-3)
    sched = build_scheduler(opt, total=10, warmup=2)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2e-3 * lr_factor(s, total=10, warmup=2) for s in range(10)])


def test_epoch_order_is_a_deterministic_permutation() -> None:
    n, bsz = 11, 4
    assert steps_per_epoch(n, bsz) == 3
    for epoch in range(3):
        order = epoch_order(n, epoch, seed=7)
        assert sorted(order) == list(range(n)) and order == epoch_order(n, epoch, seed=7)
        batches = [batch_indices(n, epoch, b, bsz, seed=7) for b in range(3)]
        assert [len(b) for b in batches] == [4, 4, 3] and sum(batches, []) == order
    assert epoch_order(n, 0, seed=7) != epoch_order(n, 1, seed=7)
    assert epoch_order(n, 0, seed=7, shuffle=False) == list(range(n))


def test_config_rejects_bad_settings_before_start(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="micro_batch_max_tokens"):
        load_config(SFTConfig, overrides=["data.max_length=4096", "micro_batch_max_tokens=1024"])
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(SFTConfig, overrides=["optim.lr=0"])
    with pytest.raises(ConfigError, match="epoch"):
        load_config(SFTConfig, overrides=["epoch=3"])  # typo: unknown key
    cfg = load_config(SFTConfig, overrides=["batch_size=6"])
    assert cfg.token_budget == 4 * 16384
    with pytest.raises(ConfigError, match="batch_size=6 is not divisible by data-parallel size 4"):
        cfg.validate_parallel(4)
    assert cfg.validate_parallel(2) == (2, 1)
    with pytest.raises(ConfigError, match="model_path"):
        SFTRunner(cfg)


def test_reference_config_file_has_the_reference_settings() -> None:
    cfg = load_config(SFTConfig, file="configs/sft_reference.yaml")
    assert (cfg.data.max_length, cfg.batch_size, cfg.micro_batch_size, cfg.optim.lr, cfg.optim.weight_decay,
            cfg.epochs) == (16384, 32, 4, 1e-5, 0.01, 6)
    load_config(SFTConfig, file="configs/sft_tiny_cpu.yaml")


def test_micro_batch_plans_cover_every_sequence_once_with_equal_counts() -> None:
    lengths = [40, 9, 23, 17, 31, 12, 6, 28, 3]
    for world in (1, 2, 3):
        plans = [plan_local(lengths, 48, r, world) for r in range(world)]
        assert len({len(p) for p in plans}) == 1
        seen = sorted(i for p in plans for micro in p for i in micro)
        assert seen == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in micro) <= 48 for p in plans for micro in p)


def _samples() -> list[Any]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in (30, 9, 21, 14, 26):
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        mask[n // 2] = 0  # a tool-result token inside the response
        out.append(to_train_sample(Rendered(ids, mask)))
    return out


def _runner(budget: int) -> SFTRunner:
    cfg = SFTConfig(model_path="unused", micro_batch_max_tokens=budget, data={"max_length": 30,  # type: ignore[arg-type]
                    "train_files": ["unused"]}, optim={"grad_clip": 1e9})  # type: ignore[arg-type]
    runner = SFTRunner(cfg)
    runner.actor = Actor(tiny_qwen2(seed=1), chunk_tokens=8, entropy=False)  # as _setup_model builds it
    runner.optimizer = torch.optim.SGD(runner.actor.parameters(), lr=0.1)
    runner.device, runner.autocast = torch.device("cpu"), False
    return runner


def test_loss_is_the_token_mean_nll_over_the_batch_whatever_the_micro_batches() -> None:
    samples = _samples()
    lm = tiny_qwen2(seed=1)
    nll, count = 0.0, 0
    with torch.no_grad():  # reference: plain HF forward per sequence, cross-entropy on masked targets
        for s in samples:
            logits = lm(input_ids=s.input_ids[None]).logits[0, :-1]
            ce = torch.nn.functional.cross_entropy(logits, s.input_ids[1:], reduction="none")
            nll += float((ce * s.loss_mask[1:]).sum())
            count += int(s.loss_mask.sum())
    results = []
    for budget in (30, 120):  # 5 micro-batches vs 1
        runner = _runner(budget)
        out = runner.train_batch(samples)
        results.append((out, {k: v.detach().clone() for k, v in runner.actor.named_parameters()}))
    (a, wa), (b, wb) = results
    assert a["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert a["loss_tokens"] == count
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                               rel=1e-5)
    for name, value in wa.items():
        torch.testing.assert_close(wb[name], value, atol=1e-6, rtol=1e-5)


def test_the_step_equals_plain_cross_entropy_on_every_position_in_loss_and_update() -> None:
    """SFT runs the LM head on loss-mask positions only, without entropy: the loss and the SGD update
    equal a plain HF forward over every position with a masked token-mean cross-entropy."""
    samples = _samples()
    lm = tiny_qwen2(seed=1)
    count = sum(float(s.loss_mask.sum()) for s in samples)
    loss = sum((torch.nn.functional.cross_entropy(lm(input_ids=s.input_ids[None]).logits[0, :-1],
                                                  s.input_ids[1:], reduction="none") * s.loss_mask[1:]).sum()
               for s in samples) / count
    loss.backward()  # type: ignore[union-attr]
    with torch.no_grad():
        want = {f"lm.{k}": p - 0.1 * p.grad for k, p in lm.named_parameters()}
    runner = _runner(60)
    out = runner.train_batch(samples)
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)  # type: ignore[union-attr]
    got = dict(runner.actor.named_parameters())
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name].detach(), value, atol=1e-6, rtol=1e-5)


def test_cli_dry_run_and_config_error(capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from services.cli import main

    with pytest.raises(SystemExit) as done:
        main(["sft", "run", "--config", "configs/sft_tiny_cpu.yaml", "--set", "optim.lr=2e-3", "--dry-run"])
    assert done.value.code == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["optim"]["lr"] == 2e-3 and shown["data"]["render"] == "inline"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as done:
        main(["sft", "run", "--config", "configs/sft_tiny_cpu.yaml", "--set", "batch_size=3", "--dry-run"])
    assert done.value.code == 2
    assert "batch_size=3 is not divisible" in capsys.readouterr().err
