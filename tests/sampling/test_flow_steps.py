"""Flow-matching steps: mean and std against a float64 hand computation of each formula, the log-probability of the
sampled next latent against the Gaussian density, noise level 0 against diffusers' Euler step."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from ddpo_group.sampling.flow_steps import SDE_REGISTRY, flow_step_with_logprob

D = torch.float64


def hand_mean_std(kind: str, x, v, s: float, s_next: float, a: float, first_next: float):
    """The module docstring's formulas in float64, written out per kind (``first_next``: s' where s = 1)."""
    dt = s_next - s
    if kind == "flow_sde":
        s_prime = first_next if s == 1 else s
        sigma_t = a * math.sqrt(s / (1 - s_prime))
        mean = x * (1 + sigma_t**2 * dt / (2 * s)) + v * (1 + sigma_t**2 * (1 - s) / (2 * s)) * dt
        return mean, sigma_t * math.sqrt(-dt)
    if kind == "cps":
        std = s_next * math.sin(a * math.pi / 2)
        clean_hat, noise_hat = x - s * v, x + (1 - s) * v
        return (1 - s_next) * clean_hat + math.sqrt(s_next**2 - std**2) * noise_hat, std
    clean_hat = x - s * v  # dance_sde
    return x + (v + a**2 * (x - (1 - s) * clean_hat) / (2 * s**2)) * dt, a * math.sqrt(-dt)


@pytest.mark.parametrize("kind", ["flow_sde", "cps", "dance_sde"])
@pytest.mark.parametrize("s, s_next", [(1.0, 0.8), (0.6, 0.35), (0.2, 0.0)])
def test_mean_std_and_log_prob_against_a_float64_hand_computation(kind, s, s_next):
    if kind == "cps" and s_next == 0:
        pytest.skip("cps has std 0 on the last step: tested below")
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 6, 6, generator=g, dtype=D), torch.randn(3, 4, 6, 6, generator=g, dtype=D)
    a = {"flow_sde": 0.7, "cps": 0.8, "dance_sde": 0.3}[kind]
    out = flow_step_with_logprob(kind, v.float(), x.float(), s, s_next, a, generator=torch.Generator().manual_seed(1))
    mean, std = hand_mean_std(kind, x, v, s, s_next, a, first_next=s_next)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)  # float32 step math
    torch.testing.assert_close(out.std.double(), torch.full((3,), std, dtype=D), rtol=1e-6, atol=0)
    # the sampled next latent's log-probability is the Gaussian density of it, mean over the latent dims
    density = torch.distributions.Normal(out.mean.double(), std).log_prob(out.next_latents.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), density, rtol=1e-5, atol=1e-5)
    # the recorded transition scored again gives the same log-probability (the training-time recomputation)
    again = flow_step_with_logprob(kind, v.float(), x.float(), torch.full((3,), s), torch.full((3,), s_next), a,
                                   next_latents=out.next_latents)
    assert torch.equal(again.log_prob, out.log_prob)
    # "sum" reduces over the 144 latent dims: the mean times 144
    summed = flow_step_with_logprob(kind, v.float(), x.float(), s, s_next, a, next_latents=out.next_latents, reduce="sum")
    torch.testing.assert_close(summed.log_prob, out.log_prob * 144, rtol=1e-5, atol=1e-3)


def test_flow_sde_takes_the_next_sigma_where_s_is_one():
    """sigma_t = a sqrt(s / (1 - s')) with s' = s_next at s = 1 (Flow-GRPO's sigmas[1]); the other rows use s."""
    x, v = torch.zeros(2, 4), torch.zeros(2, 4)
    out = flow_step_with_logprob("flow_sde", v, x, torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.4]), 0.7,
                                 compute_log_prob=False)
    want = [0.7 * math.sqrt(1.0 / (1 - 0.9)) * math.sqrt(0.1), 0.7 * math.sqrt(0.5 / 0.5) * math.sqrt(0.1)]
    torch.testing.assert_close(out.std, torch.tensor(want), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", sorted(SDE_REGISTRY))
def test_noise_level_zero_is_diffusers_euler_step_bitwise(kind):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(5)
    g = torch.Generator().manual_seed(2)
    theirs = ours = torch.randn(2, 4, 8, 8, generator=g)
    for n, t in enumerate(scheduler.timesteps):  # a whole Euler chain, a new velocity at every step
        v = torch.randn(2, 4, 8, 8, generator=g)
        theirs = scheduler.step(v, t, theirs, return_dict=False)[0]
        out = flow_step_with_logprob(kind, v, ours, scheduler.sigmas[n], scheduler.sigmas[n + 1], 0.0,
                                     compute_log_prob=False)
        ours = out.next_latents
        assert torch.equal(ours, theirs), (kind, n)
        assert bool((out.std == 0).all())
    x = ours
    with pytest.raises(ValueError, match="no log-probability"):
        flow_step_with_logprob(kind, v, x, 0.5, 0.3, 0.0)


def test_the_sdes_are_the_euler_step_in_expectation_as_the_noise_vanishes():
    """Each mean tends to x + v dt as a -> 0 (the ODE is every SDE's zero-noise limit)."""
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(2, 16, generator=g, dtype=D), torch.randn(2, 16, generator=g, dtype=D)
    euler = x + v * (0.3 - 0.5)
    for kind in SDE_REGISTRY:
        mean, std = hand_mean_std(kind, x, v, 0.5, 0.3, 1e-4, 0.3)
        assert float((mean - euler).abs().max()) < 1e-6 and std < 1e-3


def test_cps_last_step_is_deterministic_and_the_family_leaves_it_out_of_the_window():
    from ml_collections import ConfigDict

    from config.base import base
    from ddpo_group.models.families.flow_matching import FlowMatchingFamily
    from ddpo_group.models.tiny_random import TINY_BUILDERS

    out = flow_step_with_logprob("cps", torch.zeros(1, 4), torch.ones(1, 4), 0.2, 0.0, 0.8, compute_log_prob=False)
    assert float(out.std) == 0.0 and torch.equal(out.next_latents, out.mean)
    sample = ConfigDict({"num_steps": 4, "sde_type": "cps", "noise_level": 0.8, "sde_window_start": 0,
                         "sde_window_size": 0})
    family = FlowMatchingFamily(pipe=TINY_BUILDERS["sd3"](), config=base())  # the step kinds read no weights
    assert family.stochastic_steps(sample).tolist() == [True, True, True, False]
    assert family.noise_levels(sample) == [0.8, 0.8, 0.8, 0.0]
    sample.sde_type = "flow_sde"
    assert family.stochastic_steps(sample).tolist() == [True] * 4
