"""PPO critic: value alignment and layouts, reward placement + GAE wiring, the PPO step, config,
and the critic's checkpoint (single process; tests/integration/test_trainer_ppo_fsdp.py runs FSDP)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.common.config import ConfigError, load_config
from services.trainer.actor import Actor, tiny_qwen2
from services.trainer.algo.advantages import gae_advantages
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.config import TrainerConfig
from services.trainer.critic import Critic, load_critic
from services.trainer.packing import TrainSample
from services.trainer.ppo import CriticSettings, compute_values, outcome_token_rewards, ppo_train_step
from services.trainer.step import StepSettings
from tests.integration.test_trainer_fsdp import LENGTHS, make_samples

SETTINGS = StepSettings(mini_batch_size=4, micro_batch_max_tokens=48)


def rewarded() -> list[TrainSample]:
    return [replace(s, reward=float(i % 2)) for i, s in enumerate(make_samples())]


def make_critic(seed: int = 6) -> Critic:
    return Critic(tiny_qwen2(seed=seed).model)


def test_values_are_aligned_like_logprobs_and_independent_of_layout():
    critic = make_critic()
    samples = rewarded()
    packed = compute_values(critic, samples, SETTINGS)
    padded = compute_values(critic, samples, replace(SETTINGS, use_packing=False))
    fixed = compute_values(critic, samples, replace(SETTINGS, use_packing=False, padded_micro_batch_size=3))
    assert packed.shape == (len(LENGTHS), max(LENGTHS))
    torch.testing.assert_close(padded, packed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fixed, packed, atol=1e-5, rtol=1e-5)
    for i, n in enumerate(LENGTHS):
        assert packed[i, 0] == 0 and (packed[i, n:] == 0).all()
        assert packed[i, 1:n].abs().min() > 0
    # column t = head(hidden[t - 1]) of the sequence alone: the state before token t is emitted
    ids = samples[0].input_ids
    with torch.no_grad():
        hidden = critic.lm(input_ids=ids[None], position_ids=torch.arange(len(ids))[None]).last_hidden_state
        expected = critic.value_head(hidden[0, :-1]).squeeze(-1)
    torch.testing.assert_close(packed[0, 1:len(ids)], expected, atol=1e-5, rtol=1e-5)
    # changing token 10 changes values from column 11 on, never before
    changed = samples[0].input_ids.clone()
    changed[10] = (changed[10] + 1) % 256
    again = compute_values(critic, [replace(samples[0], input_ids=changed), *samples[1:4]], SETTINGS)
    torch.testing.assert_close(again[0, :11], packed[0, :11], atol=1e-6, rtol=0)
    assert (again[0, 11:LENGTHS[0]] - packed[0, 11:LENGTHS[0]]).abs().max() > 1e-4


def test_outcome_reward_reaches_every_policy_token_and_skips_interpreter_tokens():
    ids = torch.arange(12)
    mask = torch.tensor([0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0], dtype=torch.float32)  # ends in tool output
    sample = TrainSample(input_ids=ids, loss_mask=mask, advantages=torch.zeros(12), reward=2.5)
    rewards = outcome_token_rewards([sample], 12)
    assert rewards[0].tolist() == [0.0] * 9 + [2.5, 0.0, 0.0]  # the last policy token, not the last token
    critic = make_critic()
    values = compute_values(critic, [sample], replace(SETTINGS, mini_batch_size=1))
    adv, returns = gae_advantages(rewards, values, mask[None], gamma=1.0, lam=1.0, whiten=False)
    on = mask > 0
    torch.testing.assert_close(returns[0, on], torch.full((5,), 2.5))  # γ = λ = 1: return = outcome
    torch.testing.assert_close(adv[0, on], 2.5 - values[0, on])
    assert (adv[0, ~on] == 0).all()
    with pytest.raises(ValueError, match="sample 0 has no reward"):
        outcome_token_rewards([replace(sample, reward=None)], 12)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_ppo_step_fits_the_value_function_and_updates_the_actor():
    torch.manual_seed(0)
    actor, critic = Actor(tiny_qwen2(seed=5), chunk_tokens=16), make_critic()
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=1e-4)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=3e-4)
    samples = rewarded()
    before = _params(actor)
    # critic warm-up: the actor does not move, the critic does
    warm = ppo_train_step(actor, actor_opt, critic, critic_opt, samples, SETTINGS, CriticSettings(),
                          update_actor=False)
    assert "actor/pg_loss" not in warm and warm["critic/optimizer_steps"] == 2
    assert all(torch.equal(v, before[k]) for k, v in _params(actor).items())
    losses = [warm["critic/vf_loss"]]
    for _ in range(5):
        m = ppo_train_step(actor, actor_opt, critic, critic_opt, samples, SETTINGS, CriticSettings())
        losses.append(m["critic/vf_loss"])
    assert losses[-1] < 0.3 * losses[0], losses
    for key in ("critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/returns/mean",
                "critic/advantages/mean", "actor/pg_loss", "actor/grad_norm"):
        assert key in m, key
    assert m["critic/advantages/mean"] == pytest.approx(0.0, abs=1e-5)  # whitened over policy tokens
    assert max((v - before[k]).abs().max().item() for k, v in _params(actor).items()) > 1e-5
    with pytest.raises(ValueError, match="multiple of mini_batch_size=4"):
        ppo_train_step(actor, actor_opt, critic, critic_opt, samples[:5], SETTINGS, CriticSettings())


def test_critic_config_is_validated_with_named_fields():
    ppo = ["algorithm=ppo", "group_size=1", "batch_prompts=64", "dynamic_sampling.enabled=false"]
    cfg = load_config(TrainerConfig, overrides=[*ppo, "critic.lam=0.95", "critic.model_path=/m"])
    got = (cfg.critic.lr, cfg.critic.cliprange_value, cfg.critic.vf_coef, cfg.critic.gamma, cfg.critic.lam)
    assert got == (1e-5, 0.5, 1.0, 1.0, 0.95)
    assert cfg.critic.model_path == "/m" and cfg.critic.warmup_steps == 0
    with pytest.raises(ConfigError, match="critic.lr"):
        load_config(TrainerConfig, overrides=[*ppo, "critic.lr=0"])
    with pytest.raises(ConfigError, match="critic.gamma"):
        load_config(TrainerConfig, overrides=[*ppo, "critic.gamma=1.5"])
    with pytest.raises(ConfigError, match="critic.warmup_steps"):
        load_config(TrainerConfig, overrides=[*ppo, "critic.warmup_steps=-1"])
    with pytest.raises(ConfigError, match="critic.unknown"):
        load_config(TrainerConfig, overrides=[*ppo, "critic.unknown=1"])
    with pytest.raises(ConfigError, match="only algorithm=ppo trains a critic"):
        load_config(TrainerConfig, overrides=["critic.lam=0.9"])
    with pytest.raises(ConfigError, match="dynamic_sampling.enabled"):
        load_config(TrainerConfig, overrides=["algorithm=ppo", "group_size=1", "batch_prompts=64"])
    # a dumped grpo config (critic at its defaults) loads again
    TrainerConfig.model_validate(TrainerConfig().model_dump(mode="json"))


def test_critic_loads_from_a_model_dir_and_its_checkpoint_resumes_exactly(tmp_path):
    from services.models.tiny import init_model_dir

    model_dir = init_model_dir(tmp_path / "model", "tiny")
    ids = torch.randint(0, 2048, (30,), generator=torch.Generator().manual_seed(3))
    mask = (torch.arange(30) >= 10).float()
    samples = [TrainSample(input_ids=ids.roll(k), loss_mask=mask, advantages=mask, reward=float(k % 2))
               for k in range(4)]
    settings = StepSettings(mini_batch_size=2, micro_batch_max_tokens=64)

    def fresh() -> tuple[Actor, torch.optim.Optimizer, Critic, torch.optim.Optimizer]:
        actor = Actor(tiny_qwen2(seed=9, vocab=2048))
        critic = load_critic(str(model_dir))
        return (actor, torch.optim.AdamW(actor.parameters(), lr=1e-3), critic,
                torch.optim.AdamW(critic.parameters(), lr=1e-3))

    actor, aopt, critic, copt = fresh()
    from transformers import AutoModelForCausalLM

    base = dict(AutoModelForCausalLM.from_pretrained(str(model_dir)).model.named_parameters())
    loaded = dict(critic.lm.named_parameters())
    assert loaded.keys() == base.keys() and all(torch.equal(loaded[k], base[k]) for k in base)
    ppo_train_step(actor, aopt, critic, copt, samples, settings, CriticSettings())
    save_checkpoint(tmp_path / "ckpt", 3, actor, aopt, components={"critic": (critic, copt)})
    ppo_train_step(actor, aopt, critic, copt, samples, settings, CriticSettings())
    expected = _params(critic)

    actor2, aopt2, critic2, copt2 = fresh()
    path = latest_checkpoint(tmp_path / "ckpt").path
    assert load_checkpoint(path, actor2, aopt2, components={"critic": (critic2, copt2)}).step == 3
    ppo_train_step(actor2, aopt2, critic2, copt2, samples, settings, CriticSettings())
    for name, value in _params(critic2).items():
        torch.testing.assert_close(value, expected[name], atol=1e-7, rtol=0, msg=name)

    save_checkpoint(tmp_path / "grpo", 1, actor, aopt)  # written by a run without a critic
    with pytest.raises(ValueError, match="holds no critic state"):
        load_checkpoint(latest_checkpoint(tmp_path / "grpo").path, actor2, aopt2,
                        components={"critic": (critic2, copt2)})
