"""The critic: values for every step while sampling, clipped value regression under its own mask."""

import dataclasses

import pytest
import torch
from accelerate import Accelerator

from ddpo_group.update.critic import Critic, ValueNetwork
from helpers.batch_helpers import rollout_batch
from helpers.trainer_helpers import tiny_config, tiny_trainer


def fake_batch(B=8, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(B, T, 4, 8, 8, generator=g)
    return rollout_batch({"prompt_embeds": torch.randn(B, 16, 32, generator=g)}, latents, latents, torch.zeros(B, T),
                         {"timesteps": torch.linspace(900, 100, T).long().expand(B, T).clone()},
                         values=torch.zeros(B, T))


def test_value_network_shapes():
    net = ValueNetwork(4, 32, hidden_dim=16)
    out = net(torch.randn(6, 4, 8, 8), torch.tensor([999, 500, 1, 0, 10, 20]), torch.randn(6, 16, 32))
    assert out.shape == (6,) and out.dtype == torch.float32


def test_a_value_network_that_reads_clean_hat_sees_it_on_the_channel_axis():
    """critic.input="latent_clean_hat": [x_n, clean_hat] stacked on channels (SD/SD3 [C, h, w]) or token features (FLUX
    [L, D]). The value moves with clean_hat alone, and a network given the wrong inputs says so."""
    torch.manual_seed(0)
    t, c = torch.tensor([999, 500, 1]), torch.randn(3, 16, 32)
    for shape in ((4, 8, 8), (16, 6)):
        net = ValueNetwork(shape, 32, hidden_dim=16, with_clean_hat=True)
        x, clean_hat = torch.randn(3, *shape), torch.randn(3, *shape)
        first = net.latent[0] if len(shape) == 3 else net.latent.mlp[0]
        assert (first.in_channels if len(shape) == 3 else first.in_features) == 2 * shape[-3 if len(shape) == 3 else -1]
        with torch.no_grad():
            same, moved = net(x, t, c, clean_hat), net(x, t, c, clean_hat + 1.0)
        assert same.shape == (3,) and (same - moved).abs().min() > 0  # clean_hat alone changes every value
        with pytest.raises(ValueError, match="reads clean_hat"):
            net(x, t, c)
    with pytest.raises(ValueError, match="does not read clean_hat"):
        ValueNetwork(4, 32, hidden_dim=16)(torch.randn(2, 4, 8, 8), t[:2], c[:2], torch.randn(2, 4, 8, 8))


def test_resuming_with_another_critic_input_is_refused_and_old_checkpoints_count_as_latent(tmp_path):
    """latent_clean_hat doubles the first layer's input width: a checkpoint's critic cannot load into the other setting, so
    the resume check names the field before anything loads."""
    import json

    from ddpo_group.run.config_checks import ConfigError
    from ddpo_group.run.persistence.resume_check import STATE_FIELDS_FILE, check_resume, write_state_fields

    plain = tiny_config("group_ppo", "unused", tmp_path)
    clean_hat = tiny_config("group_ppo", "unused", tmp_path, **{"critic.input": "latent_clean_hat"})
    write_state_fields(tmp_path, plain, 1)
    assert check_resume(tmp_path, plain, 1) == []
    with pytest.raises(ConfigError, match="critic.input: checkpoint 'latent', config 'latent_clean_hat'"):
        check_resume(tmp_path, clean_hat, 1)
    fields = json.loads((tmp_path / STATE_FIELDS_FILE).read_text())
    del fields["critic.input"]  # a checkpoint written before the field existed: its critic read the latent only
    (tmp_path / STATE_FIELDS_FILE).write_text(json.dumps(fields))
    assert check_resume(tmp_path, plain, 1) == []
    with pytest.raises(ConfigError, match="critic.input"):
        check_resume(tmp_path, clean_hat, 1)


def test_critic_regresses_its_targets_under_its_mask():
    torch.manual_seed(0)
    config = tiny_config("ppo_gae", "unused", "unused",
                         **{"critic.value_clip_range": None, "critic.learning_rate": 3e-3})
    critic = Critic(config, Accelerator(cpu=True), 4, 32)
    batch = fake_batch()
    targets = batch.latents.mean(dim=(2, 3, 4)) * 3 + 1.0  # a learnable function of the latent
    mask = torch.zeros(8, 5)
    mask[:, 2] = 1  # endpoints only: the other entries never enter the loss, even as NaN
    targets = torch.where(mask > 0, targets, torch.full_like(targets, float("nan")))
    batch = dataclasses.replace(batch, critic_targets=targets, critic_mask=mask)
    first = critic.train_epoch(batch, batch_size=4)["critic/value_loss"]
    for _ in range(150):
        last = critic.train_epoch(batch, batch_size=4)["critic/value_loss"]
    assert torch.isfinite(torch.tensor(last)) and last < 0.2 * first
    # values while sampling: one per pre-step latent, from the same network
    values = critic.values(batch.latents[:2, 2:3], batch.timesteps[:2, 2:3], batch.cond["prompt_embeds"][:2])
    with torch.no_grad():
        want = critic.module(batch.latents[:2, 2], batch.timesteps[:2, 2], batch.cond["prompt_embeds"][:2])
    torch.testing.assert_close(values[:, 0], want)


def test_batched_values_equal_the_per_step_values():
    """Critic.values (one forward over all B * T pairs, used while sampling) equals the network step by step."""
    torch.manual_seed(0)
    critic = Critic(tiny_config("ppo_gae", "unused", "unused"), Accelerator(cpu=True), 4, 32)
    batch = fake_batch(B=3, T=4)
    with torch.no_grad():
        per_step = torch.stack([critic.module(batch.latents[:, n], batch.timesteps[:, n], batch.cond["prompt_embeds"])
                                for n in range(4)], dim=1)
    batched = critic.values(batch.latents, batch.timesteps, batch.cond["prompt_embeds"])
    assert batched.shape == (3, 4)
    torch.testing.assert_close(batched, per_step, rtol=1e-5, atol=1e-6)


def test_sampling_records_critic_values_for_every_step(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "values")
    round0 = trainer.rollouts.estimate_round(trainer.rollouts.sample_round(0, 0))
    values = round0.batch.values
    assert values.shape == (8, 4)
    with torch.no_grad():
        b = round0.batch
        want = trainer.critic.module(b.latents[:, 1], b.timesteps[:, 1], b.cond["prompt_embeds"])
    torch.testing.assert_close(values[:, 1], want, rtol=1e-5, atol=1e-6)
    # the critic mask of group_ppo is the estimator's endpoint mask (local rows)
    torch.testing.assert_close(b.critic_mask.cpu(), round0.out.endpoint_mask.float().cpu())
    trainer.rollouts.close()


def test_a_critic_reading_clean_hat_gets_every_steps_prediction_while_sampling_and_training(tiny_model_dir, tmp_path):
    """critic.input="latent_clean_hat": the rollout keeps clean_hat(x_n) of every step in batch.clean_hat [B, T, ...]; the
    values recorded while sampling are V(x_n, clean_hat(x_n), t_n, c); on DDIM clean_hat = (x_n - sqrt(1 - a_t) eps) /
    sqrt(a_t), so at the last step (a_t near 1) it is close to the final latent, and at the first far from it."""
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "clean_hat", **{"critic.input": "latent_clean_hat"})
    assert trainer.critic.reads_clean_hat
    b = trainer.rollouts.estimate_round(trainer.rollouts.sample_round(0, 0)).batch
    assert b.clean_hat.shape == b.latents.shape  # [8, 4, C, h, w]: every pre-step latent's prediction
    with torch.no_grad():
        want = trainer.critic.module(b.latents[:, 2], b.timesteps[:, 2], b.cond["prompt_embeds"], b.clean_hat[:, 2])
    torch.testing.assert_close(b.values[:, 2], want, rtol=1e-5, atol=1e-6)
    final = b.next_latents[:, -1]
    gap = [float((b.clean_hat[:, n] - final).norm() / final.norm()) for n in range(4)]
    assert gap[-1] < gap[0], gap
    mask = torch.zeros(8, 4, device=b.latents.device)  # the trainer's masks live beside the batch
    mask[:, 1] = 1
    b = dataclasses.replace(b, critic_targets=torch.ones_like(mask), critic_mask=mask)
    info = trainer.critic.train_epoch(b, batch_size=4)
    assert torch.isfinite(torch.tensor(info["critic/value_loss"]))
    trainer.rollouts.close()


def test_kl_in_reward_is_zero_for_the_initial_policy_and_positive_after_it_moves(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("reinforce_pp", tiny_model_dir, tmp_path, "klr")
    assert trainer.kl.in_reward and not trainer.updater.uses_reference  # KL in the reward, not also in the loss
    round0 = trainer.rollouts.estimate_round(trainer.rollouts.sample_round(0, 0))
    assert torch.equal(round0.gathered.step_rewards, torch.zeros(8, 4))
    with torch.no_grad():
        for p in trainer.updater.params:
            p.add_(0.05 * torch.randn_like(p))
    # one pair per forward in both calls: a pair's forwards are then the same float32 operations whatever the window
    # (in chunks of several pairs, the two calls would batch it with other pairs, another reduction order)
    kl = trainer.kl.rollout_kl(round0.batch, trainer.scorer, trainer.pipe.unet, 1, torch.ones(4, dtype=torch.bool))
    assert kl.shape == (8, 4) and bool((kl > 0).all())
    # with an SDE window only its steps are policy actions: their KL as before (bitwise), 0 (and no forward) elsewhere
    window = torch.tensor([False, True, True, False])
    windowed = trainer.kl.rollout_kl(round0.batch, trainer.scorer, trainer.pipe.unet, 1, window)
    assert torch.equal(windowed[:, window], kl[:, window])
    assert bool((windowed[:, ~window] == 0).all())
    trainer.rollouts.close()
