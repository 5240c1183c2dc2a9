"""FSDP2 on 2 CPU processes (gloo) updates weights exactly like one process on the same data.

Real torch.distributed process group with two spawned processes; nothing is mocked. The data
deliberately has uneven lengths so the two ranks get different numbers of tokens and one rank
runs an empty (zero-weighted) micro-batch. The checkpoint test runs FSDP2 mixed precision
(bf16 compute, fp32 master weights and gradient reduction) and resumes from a DCP checkpoint.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from services.common.process import free_port
from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.algo.policy_loss import ClipConfig
from services.trainer.packing import TrainSample
from services.trainer.step import DPInfo, StepSettings, train_step
from tests.helpers.gloo import gloo_rank

LENGTHS = [40, 9, 23, 17, 31, 12, 6, 28]


def make_samples() -> list[TrainSample]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, 256, (n,), generator=gen)
        mask = torch.zeros(n)
        mask[n // 4:] = 1
        mask[n // 2] = 0  # an "interpreter" token inside the response
        adv = mask * (1.0 if i % 2 else -0.7)
        rollout = -torch.rand(n, generator=gen) * 3
        out.append(TrainSample(input_ids=ids, loss_mask=mask, advantages=adv, rollout_logprobs=rollout))
    return out


SETTINGS = StepSettings(mini_batch_size=4, micro_batch_max_tokens=48, ppo_epochs=2,
                        loss_agg_mode="seq-mean-token-mean", clip=ClipConfig(0.2, 0.28, 3.0), tis_cap=2.0)


def make_actor() -> Actor:
    return Actor(tiny_qwen2(seed=5), chunk_tokens=16)


def make_optimizer(actor: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(actor.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)


def _worker(rank: int, world: int, port: int, out_path: str, settings: StepSettings = SETTINGS) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from services.trainer.config import FSDPConfig
    from services.trainer.fsdp import apply_fsdp2, full_state_dict

    with gloo_rank(rank, world, port):
        mesh = init_device_mesh("cpu", (world,))
        actor = apply_fsdp2(make_actor(), FSDPConfig(param_dtype="fp32", gradient_checkpointing=True), mesh)
        opt = make_optimizer(actor)
        metrics = train_step(actor, opt, make_samples(), settings, DPInfo(rank, world))
        state = full_state_dict(actor)
        if rank == 0:
            torch.save({"state": state, "metrics": metrics}, out_path)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_fsdp_two_processes_match_single_process(tmp_path):
    out_path = str(tmp_path / "fsdp.pt")
    mp.spawn(_worker, args=(2, free_port(), out_path), nprocs=2, join=True)
    got = torch.load(out_path)

    ref_actor = make_actor()
    before = {k: v.detach().clone() for k, v in ref_actor.named_parameters()}
    ref_metrics = train_step(ref_actor, make_optimizer(ref_actor), make_samples(), SETTINGS)
    assert ref_metrics["actor/optimizer_steps"] == 4  # 2 epochs x 2 mini-batches
    moved = 0.0
    for name, p in ref_actor.named_parameters():
        fsdp_p = got["state"][name]
        torch.testing.assert_close(fsdp_p, p.detach(), atol=2e-5, rtol=1e-4, msg=name)
        moved = max(moved, (p.detach() - before[name]).abs().max().item())
    assert moved > 1e-3  # the step really changed the weights
    assert got["metrics"]["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-4)


def _ckpt_worker(rank: int, world: int, port: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from services.trainer.config import FSDPConfig
    from services.trainer.fsdp import apply_fsdp2, full_state_dict

    with gloo_rank(rank, world, port):
        mesh = init_device_mesh("cpu", (world,))
        fsdp_cfg = FSDPConfig(param_dtype="bf16", reduce_dtype="fp32", gradient_checkpointing=False)
        settings = StepSettings(mini_batch_size=4, micro_batch_max_tokens=64)
        actor = apply_fsdp2(make_actor(), fsdp_cfg, mesh)
        opt = make_optimizer(actor)
        train_step(actor, opt, make_samples(), settings, DPInfo(rank, world))
        save_checkpoint(root, 1, actor, opt)
        train_step(actor, opt, make_samples(), settings, DPInfo(rank, world))
        continued = full_state_dict(actor)

        resumed_actor = apply_fsdp2(make_actor(), fsdp_cfg, mesh)
        resumed_opt = make_optimizer(resumed_actor)
        meta = load_checkpoint(latest_checkpoint(root).path, resumed_actor, resumed_opt)
        train_step(resumed_actor, resumed_opt, make_samples(), settings, DPInfo(rank, world))
        resumed = full_state_dict(resumed_actor)
        if rank == 0:
            torch.save({"continued": continued, "resumed": resumed, "step": meta.step}, f"{root}/result.pt")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_fsdp_checkpoint_resume_matches_uninterrupted_run(tmp_path):
    root = str(tmp_path / "ckpt")
    mp.spawn(_ckpt_worker, args=(2, free_port(), root), nprocs=2, join=True)
    got = torch.load(f"{root}/result.pt")
    assert got["step"] == 1
    for name, value in got["continued"].items():
        torch.testing.assert_close(got["resumed"][name], value, atol=1e-7, rtol=0, msg=name)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_sequence_mis_drops_the_same_sequences_on_every_rank(tmp_path):
    """Each rank judges only its shard; the verdicts are all-reduced, so the mini-batch normalisers
    agree and two ranks still equal one process. The cap keeps about half of the sequences."""
    import math
    from dataclasses import replace

    from services.trainer.algo.mismatch import sequence_log_ratio
    from services.trainer.step import recompute_logprobs

    filled = recompute_logprobs(make_actor(), make_samples(), SETTINGS)
    ratios = sorted(abs(sequence_log_ratio(s.old_logprobs, s.rollout_logprobs, s.loss_mask)) for s in filled)
    cap = math.exp((ratios[3] + ratios[4]) / 2)  # between the 4th and 5th of 8: 4 kept, 4 dropped
    settings = replace(SETTINGS, mis_cap=cap)
    out_path = str(tmp_path / "fsdp-mis.pt")
    mp.spawn(_worker, args=(2, free_port(), out_path, settings), nprocs=2, join=True)
    got = torch.load(out_path)
    ref_actor = make_actor()
    ref_metrics = train_step(ref_actor, make_optimizer(ref_actor), make_samples(), settings)
    assert ref_metrics["mismatch/mis_masked_frac"] == 0.5
    assert got["metrics"]["mismatch/mis_masked_frac"] == 0.5
    for k in ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/k3_kl", "mismatch/tis_capped_frac"):
        assert got["metrics"][k] == pytest.approx(ref_metrics[k], rel=1e-4), k
    for name, p in ref_actor.named_parameters():
        torch.testing.assert_close(got["state"][name], p.detach(), atol=2e-5, rtol=1e-4, msg=name)
