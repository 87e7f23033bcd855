import pytest
import torch
from ml_collections import ConfigDict

from config.base import base

from ddpo_group.sampling.ddim import check_trainable_schedule, ddim_step_with_logprob, step_std
from ddpo_group.models.families.sd import StableDiffusionFamily, encode_prompts, guided_model_output
from ddpo_group.sampling.trajectories import SamplingOptions, TransitionScorer, sample_trajectories
from ddpo_group.models.tiny_random import build_tiny_pipeline
from helpers.batch_helpers import batch_of

PROMPTS = ["a red circle on a blue background", "a green square", "x", "a yellow star on a black background"]


def sample(pipe, embeds, neg, steps, guidance_scale, noise_levels, generator=None, initial_noise=None, **options):
    """Stable Diffusion trajectories as the rollouts sample them (sampling/trajectories.py with the family);
    ``options``: SamplingOptions fields."""
    return sample_trajectories(StableDiffusionFamily(pipe, base()), pipe.unet, {"prompt_embeds": embeds},
                               {"prompt_embeds": neg}, SamplingOptions(steps, guidance_scale, noise_levels, **options),
                               generator, initial_noise)


def score(pipe, traj, embeds, rows, steps, guidance_scale, eta):
    """The step output of the recorded transitions (rows, steps) of ``traj``, as training scores them."""
    batch = batch_of(traj, {"prompt_embeds": embeds})
    return TransitionScorer(StableDiffusionFamily(pipe, base()), guidance_scale, eta)(pipe.unet, batch, rows, steps)


def _sample(pipe, guidance_scale, eta=1.0, steps=5, seed=0):
    embeds = encode_prompts(pipe, PROMPTS)
    neg = encode_prompts(pipe, [""] * len(PROMPTS))
    gen = torch.Generator().manual_seed(seed)
    return embeds, neg, sample(pipe, embeds, neg, steps, guidance_scale, [eta] * steps, generator=gen)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_log_prob_is_gaussian_density_of_step(prediction_type):
    pipe = build_tiny_pipeline(prediction_type=prediction_type)
    scheduler = pipe.scheduler
    scheduler.set_timesteps(10)
    torch.manual_seed(1)
    sample = torch.randn(3, 4, 8, 8)
    model_output = torch.randn(3, 4, 8, 8)
    t = scheduler.timesteps[4]
    out = ddim_step_with_logprob(scheduler, model_output, t, sample, eta=0.7)
    normal = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1, 1))
    expected = normal.log_prob(out.next_latents).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-5, atol=1e-5)
    # sigma from the closed form in ALGORITHMS.md
    ab = scheduler.alphas_cumprod
    ab_t, ab_prev = ab[t], ab[t - 1000 // 10]
    sigma = 0.7 * ((1 - ab_prev) / (1 - ab_t) * (1 - ab_t / ab_prev)).sqrt()
    torch.testing.assert_close(out.std, sigma.expand(3).float())
    # the sum reduction is the mean times the number of latent dims
    summed = ddim_step_with_logprob(scheduler, model_output, t, sample, 0.7, next_latents=out.next_latents, reduce="sum")
    torch.testing.assert_close(summed.log_prob, expected * 4 * 8 * 8, rtol=1e-5, atol=1e-3)


def test_step_matches_diffusers_ddim_step():
    pipe = build_tiny_pipeline()
    scheduler = pipe.scheduler
    scheduler.set_timesteps(8)
    torch.manual_seed(2)
    sample, model_output = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    for t in scheduler.timesteps:
        ours = ddim_step_with_logprob(scheduler, model_output, t, sample, 1.0, generator=torch.Generator().manual_seed(3))
        ref = scheduler.step(model_output, t, sample, eta=1.0, generator=torch.Generator().manual_seed(3)).prev_sample
        torch.testing.assert_close(ours.next_latents, ref, rtol=1e-5, atol=1e-5)


def test_recorded_log_probs_have_gaussian_density_along_trajectory(tiny_pipe):
    embeds, neg, traj = _sample(tiny_pipe, guidance_scale=4.0)
    B, T = traj.log_probs.shape
    assert traj.latents.shape == (B, T + 1, 4, 8, 8)
    assert traj.timesteps.shape == (B, T) and traj.images.shape == (B, 3, 16, 16)
    assert float(traj.images.min()) >= 0.0 and float(traj.images.max()) <= 1.0
    # recompute each step's mean independently and check the density under torch's Normal
    for n in range(T):
        out = score(tiny_pipe, traj, embeds, torch.arange(B), torch.full((B,), n), 4.0, 1.0)
        normal = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1, 1))
        expected = normal.log_prob(traj.latents[:, n + 1]).mean(dim=(1, 2, 3))
        torch.testing.assert_close(traj.log_probs[:, n], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_recomputed_log_probs_give_ratio_one_batched_over_pairs(tiny_pipe, guidance_scale):
    embeds, neg, traj = _sample(tiny_pipe, guidance_scale)
    B, T = traj.log_probs.shape
    # flatten every (sample, step) pair into the batch dimension: one forward for all of them
    idx_b = torch.arange(B).repeat_interleave(T)
    idx_t = torch.arange(T).repeat(B)
    with torch.no_grad():
        out = score(tiny_pipe, traj, embeds, idx_b, idx_t, guidance_scale, 1.0)
    ratio = torch.exp(out.log_prob.view(B, T) - traj.log_probs)
    torch.testing.assert_close(ratio, torch.ones(B, T), rtol=0, atol=2e-4)


@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_images_match_diffusers_pipeline(tiny_pipe, eta):
    _, _, traj = _sample(tiny_pipe, guidance_scale=5.0, eta=eta, steps=6, seed=7)
    ref = tiny_pipe(
        PROMPTS, num_inference_steps=6, guidance_scale=5.0, eta=eta, generator=torch.Generator().manual_seed(7),
        output_type="pt",
    ).images
    torch.testing.assert_close(traj.images, ref, rtol=1e-4, atol=1e-4)


def test_eta_zero_has_no_log_prob(tiny_pipe):
    with pytest.raises(ValueError, match="eta"):
        check_trainable_schedule(tiny_pipe.scheduler, 10, 0.0)
    scheduler = tiny_pipe.scheduler
    scheduler.set_timesteps(4)
    with pytest.raises(ValueError, match="eta=0"):
        ddim_step_with_logprob(scheduler, torch.zeros(1, 4, 8, 8), scheduler.timesteps[0], torch.zeros(1, 4, 8, 8), 0.0)
    assert float(step_std(scheduler, scheduler.timesteps, 0.0).abs().max()) == 0.0
    # greedy sampling (ReMax's baseline) works without log-probs and matches diffusers at eta = 0
    embeds, neg = encode_prompts(tiny_pipe, PROMPTS), encode_prompts(tiny_pipe, [""] * len(PROMPTS))
    gen = torch.Generator().manual_seed(3)
    traj = sample(tiny_pipe, embeds, neg, 5, 5.0, [0.0] * 5, generator=gen, compute_log_prob=False)
    ref = tiny_pipe(PROMPTS, num_inference_steps=5, guidance_scale=5.0, eta=0.0,
                    generator=torch.Generator().manual_seed(3), output_type="pt").images
    torch.testing.assert_close(traj.images, ref, rtol=1e-4, atol=1e-4)


def test_schedule_with_zero_final_sigma_is_rejected():
    pipe = build_tiny_pipeline()
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_config(pipe.scheduler.config, set_alpha_to_one=True)
    with pytest.raises(ValueError, match="set_alpha_to_one"):
        check_trainable_schedule(scheduler, 10, 1.0)


def test_sde_window_steps_outside_are_deterministic_ddim_without_log_prob(tiny_pipe):
    from ddpo_group.sampling.window import sde_window_mask, stochastic_steps

    def noise_levels(eta, start, size):  # the family's noise level of each step (what the rollouts sample with)
        return StableDiffusionFamily(tiny_pipe, base()).noise_levels(
            ConfigDict({"num_steps": 5, "noise_level": eta, "sde_window_start": start, "sde_window_size": size}))

    assert sde_window_mask(5, 0, 0).tolist() == [True] * 5
    assert noise_levels(0.7, 1, 2) == [0.0, 0.7, 0.7, 0.0, 0.0]
    assert stochastic_steps(ConfigDict({"num_steps": 4, "sde_window_start": 2, "sde_window_size": 1})).tolist() == [
        False, False, True, False]
    embeds, neg = encode_prompts(tiny_pipe, PROMPTS), encode_prompts(tiny_pipe, [""] * len(PROMPTS))
    x_0 = torch.randn(len(PROMPTS), 4, 8, 8, generator=torch.Generator().manual_seed(0))

    def sample_window(etas, seed):
        return sample(tiny_pipe, embeds, neg, 5, 5.0, etas, generator=torch.Generator().manual_seed(seed),
                      initial_noise=x_0)

    window_etas = noise_levels(1.0, 1, 2)
    windowed, other_noise = sample_window(window_etas, 0), sample_window(window_etas, 1)
    # log-probs only inside the window; there they are the Gaussian step densities (ratio one on recomputation)
    assert (windowed.log_probs[:, [0, 3, 4]] == 0).all() and (windowed.log_probs[:, 1:3] != 0).all()
    for n in (1, 2):
        out = score(tiny_pipe, windowed, embeds, torch.arange(len(PROMPTS)), torch.full((len(PROMPTS),), n), 5.0, 1.0)
        torch.testing.assert_close(out.log_prob, windowed.log_probs[:, n], rtol=0, atol=2e-4)
    # step 0 is the deterministic DDIM step whatever the noise; the window's noise makes the samples differ after it
    torch.testing.assert_close(windowed.latents[:, 1], other_noise.latents[:, 1], rtol=0, atol=0)
    assert (windowed.latents[:, 2] - other_noise.latents[:, 2]).abs().max() > 1e-2
    with torch.no_grad():  # a step outside the window is DDIM's eta = 0 step
        output = guided_model_output(tiny_pipe.unet, windowed.latents[:, 3], windowed.timesteps[:, 3], embeds, neg, 5.0)
    greedy = ddim_step_with_logprob(tiny_pipe.scheduler, output, windowed.timesteps[:, 3], windowed.latents[:, 3], 0.0,
                                    compute_log_prob=False)
    torch.testing.assert_close(greedy.next_latents, windowed.latents[:, 4], rtol=1e-5, atol=1e-5)
    # a window of every step is the plain sampler, bit for bit
    every_step = noise_levels(1.0, 0, 5)
    torch.testing.assert_close(sample_window(every_step, 3).latents, sample_window([1.0] * 5, 3).latents,
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="deterministic"):
        sample(tiny_pipe, embeds, neg, 5, 5.0, [0.0] * 5)
    # the trainable-schedule check asks sigma > 0 of the window's steps only
    check_trainable_schedule(tiny_pipe.scheduler, 5, 1.0, sde_window_mask(5, 1, 2))


def test_log_prob_reduce_sum_scales_the_recorded_log_probs_and_the_ratio_exponent_by_the_dimension_count(tiny_pipe):
    """sample.log_prob_reduce reaches the step log-prob while sampling and when transitions are scored for training:
    with "sum" every log-prob, and so every log-ratio l_new - l_rollout, is D = C * h * w times the "mean" one."""
    embeds, neg = encode_prompts(tiny_pipe, PROMPTS[:2]), encode_prompts(tiny_pipe, [""])
    traj = {reduce: sample(tiny_pipe, embeds, neg.expand(2, -1, -1), 4, 5.0, [1.0] * 4, decode=False,
                           generator=torch.Generator().manual_seed(3), log_prob_reduce=reduce)
            for reduce in ("mean", "sum")}
    dims = 4 * 8 * 8
    assert torch.equal(traj["mean"].latents, traj["sum"].latents)
    torch.testing.assert_close(traj["sum"].log_probs, dims * traj["mean"].log_probs, rtol=1e-5, atol=1e-3)
    with torch.no_grad():  # another policy, so that the ratios differ from 1
        for p in tiny_pipe.unet.parameters():
            p.add_(0.01 * torch.randn_like(p))
    rows, steps = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 2, 1, 3])
    log_ratio = {}
    for reduce, t in traj.items():
        batch = batch_of(t, {"prompt_embeds": embeds})
        with torch.no_grad():
            out = TransitionScorer(StableDiffusionFamily(tiny_pipe, base()), 5.0, 1.0, reduce)(tiny_pipe.unet, batch, rows, steps)
        log_ratio[reduce] = out.log_prob - t.log_probs[rows, steps]
    assert log_ratio["mean"].abs().min() > 0
    torch.testing.assert_close(log_ratio["sum"], dims * log_ratio["mean"], rtol=1e-3, atol=1e-4)
