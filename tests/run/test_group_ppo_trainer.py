"""GROUP_PPO in the trainer: critic mask = endpoint mask, the group_max_size = 1 limit is GAE, state survives resume."""

import torch

from ddpo_group.algorithms import AdvantageInputs, get_adv_estimator
from ddpo_group.rollout.collector import estimate_advantages
from helpers.trainer_helpers import tiny_config, tiny_trainer


def rollout(B=16, T=6, G=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(B, generator=g, dtype=torch.float64)
    values = torch.rand(B, T, generator=g, dtype=torch.float64)
    groups = torch.arange(B) // G
    prompts = [f"prompt {int(i)}" for i in groups]
    return AdvantageInputs(rewards, torch.ones(B, T, dtype=torch.float64), groups, prompts, values=values)


def test_critic_mask_is_the_endpoint_mask():
    inputs = rollout()
    config = tiny_config("group_ppo", "unused", "unused", **{"group_ppo.max_segment_steps": 3})
    estimator = get_adv_estimator("group_ppo")
    out = estimate_advantages(estimator, config, inputs)
    targets, mask = estimator.critic_regression(out)
    assert torch.equal(mask, out.endpoint_mask) and torch.equal(targets, out.critic_targets)
    # K - 1 targets per trajectory, at the column after each endpoint but the last (pre-step indexing)
    ends = out.extras["step_endpoints"]
    assert torch.equal(mask.sum(dim=1), ends.sum(dim=1).double() - 1)
    assert torch.equal(mask[:, 1:].bool(), ends[:, :-1])
    # gae trains the critic on every step
    gae = tiny_config("ppo_gae", "unused", "unused")
    gae_estimator = get_adv_estimator("gae")
    _, gae_mask = gae_estimator.critic_regression(
        estimate_advantages(gae_estimator, gae, inputs))
    assert bool((gae_mask == 1).all())


def test_group_max_size_one_equals_ppo_gae_on_the_same_rollout():
    inputs = rollout()
    for lam in (1.0, 0.9, 0.0):
        # the limit holds for the plain critic's values without std scaling (the preset uses neither: docs/group_ppo.md)
        group = tiny_config("group_ppo", "unused", "unused", **{
            "group_ppo.max_segment_steps": 1, "group_ppo.gae_lambda": lam, "train.adv_clip_max": 1e9,
            "group_ppo.value_source": "critic", "train.scale_rewards": False})
        gae = tiny_config("ppo_gae", "unused", "unused", **{
            "algorithm.gae_lambda": lam, "algorithm.gae_whiten": False, "algorithm.gae_start_value": "group_mean",
            "train.adv_clip_max": 1e9})
        a = estimate_advantages(get_adv_estimator("group_ppo"), group, inputs)
        b = estimate_advantages(get_adv_estimator("gae"), gae, inputs)
        assert a.metrics["segment/mean_len"] == 1.0
        torch.testing.assert_close(a.advantages, b.advantages, rtol=0, atol=1e-12)


def test_controller_and_critic_state_survive_a_checkpoint_round_trip(tiny_model_dir, tmp_path):
    overrides = {"group_ppo.threshold_lr": 0.5, "save_freq": 1}
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "resume", **overrides)
    trainer.run()
    tau, ev = trainer.estimator_controller.tau, trainer.estimator_controller.last_ev
    assert tau != trainer.config.group_ppo.variance_threshold  # the controller moved
    critic = [p.detach().clone() for p in trainer.critic.module.parameters()]
    critic_opt = trainer.critic.optimizer.state_dict()["state"]

    resumed = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "resume", resume_from=str(tmp_path / "resume"),
                           **overrides)
    assert resumed.state.epoch == 0
    assert resumed.estimator_controller.tau == tau
    assert resumed.estimator_controller.last_ev == ev or (ev != ev and resumed.estimator_controller.last_ev != resumed.estimator_controller.last_ev)
    for a, b in zip(critic, resumed.critic.module.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(resumed.critic.optimizer.state_dict()["state"][0]["exp_avg"], critic_opt[0]["exp_avg"])
    resumed.rollouts.close()


def test_reference_and_kl_controller_survive_a_checkpoint_round_trip(tiny_model_dir, tmp_path):
    overrides = {"save_freq": 1, "kl.reference_update_freq": 1, "kl.reference_mixup_alpha": 0.5,
                 "kl.controller": "adaptive", "kl.horizon": 10.0}
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "ref", **overrides)
    metrics = trainer.run()
    beta = trainer.kl.beta
    assert beta != trainer.config.kl.beta and metrics["ref/last_update_epoch"] == 0
    unet = trainer.accelerator.unwrap_model(trainer.model)
    distance = trainer.kl.reference.param_distance(unet)
    resumed = tiny_trainer("grpo", tiny_model_dir, tmp_path, "ref", resume_from=str(tmp_path / "ref"), **overrides)
    assert resumed.kl.beta == beta and resumed.kl.reference.last_update_epoch == 0
    assert resumed.kl.reference.param_distance(resumed.accelerator.unwrap_model(resumed.model)) == distance
    resumed.rollouts.close()


def test_a_fixed_tau_of_zero_is_allowed_without_adaptation_and_makes_every_step_its_own_group(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "tau0", **{
        "group_ppo.variance_threshold": 0.0, "group_ppo.adaptive_threshold": False})
    round0 = trainer.rollouts.estimate_round(trainer.rollouts.sample_round(0, 0))
    assert trainer.estimator_controller.tau == 0.0 and round0.out.metrics["segment/tau"] == 0.0
    assert round0.out.metrics["segment/mean_len"] == 1.0  # K = T endpoints: tau = 0 cuts at every step
    trainer.rollouts.close()
