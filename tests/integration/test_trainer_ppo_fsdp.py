"""PPO with a critic under FSDP2 on 2 CPU processes (gloo): same update as one process, and the
critic's weights + Adam state resume exactly from a DCP checkpoint.

Real process group, nothing mocked. Uneven lengths give the ranks different token counts and one
rank an empty (zero-weighted) micro-batch. The checkpoint test runs bf16 mixed precision for the
backbone (the value head stays an fp32 unit).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from services.common.process import free_port
from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.critic import Critic
from services.trainer.packing import TrainSample
from services.trainer.ppo import CriticSettings, ppo_train_step
from services.trainer.step import DPInfo, StepSettings
from tests.helpers.gloo import gloo_rank
from tests.integration.test_trainer_fsdp import make_samples

SETTINGS = StepSettings(mini_batch_size=4, micro_batch_max_tokens=48, ppo_epochs=2,
                        loss_agg_mode="seq-mean-token-mean")
CRITIC = CriticSettings(cliprange_value=0.2, gamma=0.99, lam=0.95)
Models = tuple[Actor, Critic, torch.optim.Optimizer, torch.optim.Optimizer]


def samples() -> list[TrainSample]:
    return [replace(s, reward=float(i % 3) - 0.5) for i, s in enumerate(make_samples())]


def make_models() -> Models:
    actor = Actor(tiny_qwen2(seed=5), chunk_tokens=16)
    critic = Critic(tiny_qwen2(seed=6).model, head_seed=1)
    return actor, critic, _adam(actor), _adam(critic)


def _adam(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)


def _sharded(world: int, param_dtype: str) -> Models:
    from torch.distributed.device_mesh import init_device_mesh

    from services.trainer.config import FSDPConfig
    from services.trainer.fsdp import apply_fsdp2

    mesh = init_device_mesh("cpu", (world,))
    cfg = FSDPConfig(param_dtype=param_dtype, reduce_dtype="fp32",
                     gradient_checkpointing=param_dtype == "fp32")
    actor, critic, _, _ = make_models()
    apply_fsdp2(actor, cfg, mesh)
    apply_fsdp2(critic, cfg, mesh)
    return actor, critic, _adam(actor), _adam(critic)


def _step_worker(rank: int, world: int, port: int, out_path: str) -> None:
    from services.trainer.fsdp import full_state_dict

    with gloo_rank(rank, world, port):
        actor, critic, aopt, copt = _sharded(world, "fp32")
        metrics = ppo_train_step(actor, aopt, critic, copt, samples(), SETTINGS, CRITIC, DPInfo(rank, world))
        state = {"actor": full_state_dict(actor), "critic": full_state_dict(critic)}
        if rank == 0:
            torch.save({**state, "metrics": metrics}, out_path)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_ppo_step_on_two_ranks_matches_one_process(tmp_path):
    out_path = str(tmp_path / "ppo.pt")
    mp.spawn(_step_worker, args=(2, free_port(), out_path), nprocs=2, join=True)
    got = torch.load(out_path)

    actor, critic, aopt, copt = make_models()
    before = {k: v.detach().clone() for k, v in critic.named_parameters()}
    ref = ppo_train_step(actor, aopt, critic, copt, samples(), SETTINGS, CRITIC)
    assert ref["critic/optimizer_steps"] == 4 and ref["actor/optimizer_steps"] == 4
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean", "critic/returns/mean",
                "critic/advantages/max", "actor/grad_norm"):
        assert got["metrics"][key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    # clipfrac counts (v_clipped - R)² > (v - R)²; inside the clip range the two differ only by
    # rounding, so a token or two may flip between layouts (as in verl)
    assert got["metrics"]["critic/vf_clipfrac"] == pytest.approx(ref["critic/vf_clipfrac"], abs=0.01)
    for model, name in ((actor, "actor"), (critic, "critic")):
        for key, p in model.named_parameters():
            torch.testing.assert_close(got[name][key], p.detach(), atol=2e-5, rtol=1e-4, msg=f"{name}.{key}")
    assert (critic.value_head.weight.detach() - before["value_head.weight"]).abs().max() > 1e-3


def _ckpt_worker(rank: int, world: int, port: int, root: str) -> None:
    from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from services.trainer.fsdp import full_state_dict

    with gloo_rank(rank, world, port):
        settings = replace(SETTINGS, ppo_epochs=1, micro_batch_max_tokens=64)
        dp = DPInfo(rank, world)
        actor, critic, aopt, copt = _sharded(world, "bf16")
        ppo_train_step(actor, aopt, critic, copt, samples(), settings, CRITIC, dp)
        save_checkpoint(root, 1, actor, aopt, components={"critic": (critic, copt)})
        ppo_train_step(actor, aopt, critic, copt, samples(), settings, CRITIC, dp)
        continued = {"actor": full_state_dict(actor), "critic": full_state_dict(critic)}

        actor2, critic2, aopt2, copt2 = _sharded(world, "bf16")
        meta = load_checkpoint(latest_checkpoint(root).path, actor2, aopt2,
                               components={"critic": (critic2, copt2)})
        ppo_train_step(actor2, aopt2, critic2, copt2, samples(), settings, CRITIC, dp)
        resumed = {"actor": full_state_dict(actor2), "critic": full_state_dict(critic2)}
        head_dtype = critic2.value_head.weight.dtype  # master weights: fp32
        if rank == 0:
            result = {"continued": continued, "resumed": resumed, "step": meta.step, "head_dtype": head_dtype}
            torch.save(result, f"{root}/result.pt")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_ppo_checkpoint_resume_restores_the_critic_exactly(tmp_path):
    root = str(tmp_path / "ckpt")
    mp.spawn(_ckpt_worker, args=(2, free_port(), root), nprocs=2, join=True)
    got = torch.load(f"{root}/result.pt")
    assert got["step"] == 1 and got["head_dtype"] == torch.float32
    for name in ("actor", "critic"):
        assert got["continued"][name].keys() == got["resumed"][name].keys()
        for key, value in got["continued"][name].items():
            torch.testing.assert_close(got["resumed"][name][key], value, atol=1e-7, rtol=0,
                                       msg=f"{name}.{key}")
