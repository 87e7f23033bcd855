"""GROUP_PPO's Tweedie values (rollout/tweedie.py): the reward of each valued step's decoded one-step prediction, by
hand on the tiny models; the other columns are the terminal reward; the extra reward calls count as queries."""

from pathlib import Path

import pytest
import torch

from ddpo_group.rollout.tweedie import valued_steps, with_rewards
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

BRIGHTNESS = f"{Path(__file__).resolve().parents[1] / 'plugins' / 'failing_reward.py'}:make"  # mean pixel value


def test_valued_steps_run_from_one_to_the_last_stochastic_step():
    assert valued_steps(torch.tensor([True, True, False, False])) == [1]  # the default 2-step window
    assert valued_steps(torch.tensor([False, True, True, False, False])) == [1, 2]
    assert valued_steps(torch.tensor([True, True, True, True])) == [1, 2, 3]
    assert valued_steps(torch.tensor([True, False, False])) == []  # one stochastic step: every value is R exactly
    values = torch.tensor([[float("nan"), 0.5, float("nan")]], dtype=torch.float64)
    assert with_rewards(values, torch.tensor([0.9], dtype=torch.float64)).tolist() == [[0.9, 0.5, 0.9]]


def hand_clean_hat(family, model_output, latents, times):
    """clean_hat(x_n) from the model's output, written out: DDIM (x - sqrt(1 - ab_t) eps) / sqrt(ab_t); flow x - s v."""
    if "sigmas" in times:
        return latents - times["sigmas"].view(-1, *[1] * (latents.ndim - 1)) * model_output
    ab = family.pipe.scheduler.alphas_cumprod[times["timesteps"].long().cpu()].to(latents.device)
    ab = ab.view(-1, *[1] * (latents.ndim - 1))
    return (latents - (1 - ab).sqrt() * model_output) / ab.sqrt()


# "latent_clean_hat": a critic that reads clean_hat makes the rollout keep it at every step; the Tweedie values take their steps
@pytest.mark.parametrize("family_name,critic_input", [("sd", "latent"), ("sd3", "latent"), ("sd", "latent_clean_hat")])
def test_tweedie_values_are_the_reward_of_the_decoded_one_step_prediction(family_name, critic_input, family_model_dirs,
                                                                          tmp_path):
    trainer = tiny_trainer("group_ppo", family_model_dirs[family_name], tmp_path, reward_fn=BRIGHTNESS,
                           **{"group_ppo.value_source": "tweedie", "critic.input": critic_input, "sample.num_steps": 4,
                              "sample.sde_window_size": 3, **FAMILY_OVERRIDES[family_name]})
    family = trainer.family
    assert trainer.rollouts.sampler.tweedie_steps == [1, 2]  # window [0, 3): x_1, x_2 valued; x_3 is followed by no noise
    rollouts = trainer.rollouts.estimate(trainer.rollouts.collect(0))
    batch = rollouts.batch
    values, rewards = batch.tweedie_values, batch.rewards
    B = len(rewards)
    assert rollouts.reward_queries == B + 2 * B  # the images, then one one-step prediction per sample and valued step
    torch.testing.assert_close(values[:, [0, 3]], rewards.double()[:, None].expand(B, 2), rtol=0, atol=0)
    family.schedule(4, trainer.accelerator.device)
    for b in (0, B - 1):
        for n in (1, 2):
            times = {key: batch.times[key][b : b + 1, n] for key in family.time_keys}
            cond = {key: batch.cond[key][b : b + 1] for key in family.cond_keys}
            latents = batch.latents[b : b + 1, n]
            with torch.no_grad():
                output = family.model_output(family.model, latents, times, cond, family.negative_condition(),
                                             trainer.config.sample.guidance_scale)
                clean_hat = hand_clean_hat(family, output.float(), latents.float(), times)
                image = family.decode(clean_hat)
            assert abs(float(image.double().mean()) - float(values[b, n])) < 1e-5, (b, n)
            if critic_input == "latent_clean_hat":  # the critic's input at step n is the same prediction
                # one row here, every row at once while sampling: on CUDA, convolutions in TF32 (cuDNN's default)
                # round the two differently by about 1e-3
                tol = 1e-4 if latents.device.type == "cpu" else 5e-3
                torch.testing.assert_close(batch.clean_hat[b : b + 1, n], clean_hat, rtol=tol, atol=tol)
    assert (batch.clean_hat is not None) == (critic_input == "latent_clean_hat")
    # the estimator reads them: V = the Tweedie values (a plain critic run on the same values gives the same advantages)
    assert torch.isfinite(batch.advantages).all()
