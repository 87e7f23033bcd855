"""GRPO-Guard's RatioNorm (policy loss ratio_norm): exactly 1 at the rollout policy, the formula by hand, the identity
log rho_hat = mean_D(z * dmu) for both log-prob reductions, and no bias where the plain ratio's mean is below 1."""

import math

import pytest
import torch

from ddpo_group.algorithms import aggregation_weights, get_policy_loss, ratio_norm_policy_loss
from ddpo_group.algorithms.policy_losses import ratio_norm_config_errors, ratio_norm_log_ratio
from ddpo_group.sampling.gaussian import gaussian_log_prob

CLIP = dict(clip_low=0.05, clip_high=0.05, clip_ratio_c=3.0)


def ratio_norm_terms(old_lp, lp, adv, **kwargs):
    """Each pair's term L of the loss (its weight 1, every other's 0), and the metrics over all the pairs."""
    one_hot = torch.eye(len(adv))
    terms = torch.stack([ratio_norm_policy_loss(old_lp, lp, adv, one_hot[i], **CLIP, **kwargs)[0]
                         for i in range(len(adv))])
    return terms, ratio_norm_policy_loss(old_lp, lp, adv, torch.ones(len(adv)), **CLIP, **kwargs)[1]


def test_the_ratio_is_exactly_one_at_the_rollout_policy():
    torch.manual_seed(0)
    rollout_mean = torch.randn(5, 4, 3)
    std, length = torch.tensor([0.5, 0.1, 0.02, 1.0, 0.3]), torch.tensor([0.1, 0.2, 0.05, 0.3, 0.25])
    x = rollout_mean + std[:, None, None] * torch.randn(5, 4, 3)
    lp = gaussian_log_prob(x, rollout_mean, std)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5, -3.0])
    loss, metrics = ratio_norm_terms(lp, lp.clone(), adv, mean=rollout_mean.clone(), rollout_mean=rollout_mean, std=std,
                                     step_length=length)
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0 and metrics["clipfrac"] == 0.0
    assert torch.equal(loss, -adv / length)  # rho = exp(0) = 1 exactly, weight 1 / step length


def test_the_formula_against_a_hand_computation():
    """Two steps of three latent dims; every number below is worked out by hand from z = (x' - mu_rollout) / s."""
    rollout_mean = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mean = torch.tensor([[0.1, -0.2, 0.0], [1.0, 1.05, 0.95]], requires_grad=True)
    x = torch.tensor([[0.5, -0.5, 0.25], [1.25, 0.75, 1.0]])
    std, length = torch.tensor([0.5, 0.25]), torch.tensor([0.1, 0.2])
    old_lp, lp = gaussian_log_prob(x, rollout_mean, std), gaussian_log_prob(x, mean, std)
    log_ratio, d, b = ratio_norm_log_ratio(old_lp, lp, mean, rollout_mean, std)
    # z = [1, -1, 0.5] and [1, -1, 0]; dmu = [0.1, -0.2, 0] and [0, 0.05, -0.05]
    # b = mean(dmu^2) / (2 s^2) = (0.05 / 3) / 0.5 and (0.005 / 3) / 0.125;  log rho_hat = mean(z dmu)
    torch.testing.assert_close(b, torch.tensor([1 / 30, 1 / 75]))
    torch.testing.assert_close(log_ratio, torch.tensor([0.1, -1 / 60]))
    torch.testing.assert_close(d, torch.tensor([0.1 / 0.5 - 1 / 30, (-1 / 60) / 0.25 - 1 / 75]))
    adv = torch.tensor([1.0, -2.0])
    loss, metrics = ratio_norm_terms(old_lp, lp, adv, mean=mean, rollout_mean=rollout_mean, std=std, step_length=length)
    # step 0: rho = e^0.1 = 1.105 > 1.05 with A = 1 -> clipped, -1.05, weight 1 / 0.1
    # step 1: rho = e^(-1/60) = 0.9835 inside the clip with A = -2 -> 2 rho (dual clip 6 inactive), weight 1 / 0.2
    torch.testing.assert_close(loss, torch.tensor([-10.5, 2 * math.exp(-1 / 60) / 0.2]))
    assert metrics["clipfrac"] == 0.5 and metrics["clipfrac_lower"] == 0.0
    assert metrics["mean_shift_bias"] == pytest.approx((1 / 30 + 1 / 75) / 2)
    unweighted, _ = ratio_norm_terms(old_lp, lp, adv, mean=mean, rollout_mean=rollout_mean, std=std, step_length=length,
                                     reweight="none")
    torch.testing.assert_close(unweighted, torch.tensor([-1.05, 2 * math.exp(-1 / 60)]))
    # the gradient is that of mean_D(z * mu_theta): for the unclipped step 1, d(2 rho / 0.2)/d mu = 10 rho z / 3
    loss.sum().backward()
    z1 = torch.tensor([1.0, -1.0, 0.0])
    torch.testing.assert_close(mean.grad[1], 10 * math.exp(-1 / 60) * z1 / 3)
    torch.testing.assert_close(mean.grad[0], torch.zeros(3))  # clipped: no gradient


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_the_normalised_log_ratio_is_the_noise_times_the_mean_shift(reduce):
    """(d + b) s = mean_D(z * dmu) exactly (to float rounding), with d per latent dimension under either reduction."""
    g = torch.Generator().manual_seed(1)
    rollout_mean, z = torch.randn(6, 4, 8, 8, generator=g), torch.randn(6, 4, 8, 8, generator=g)
    dmu = 0.01 * torch.randn(6, 4, 8, 8, generator=g)
    std = torch.tensor([0.5, 0.2, 0.05, 0.01, 1.0, 0.1])
    x = rollout_mean + std[:, None, None, None] * z
    old_lp = gaussian_log_prob(x, rollout_mean, std, reduce)
    lp = gaussian_log_prob(x, rollout_mean + dmu, std, reduce)
    log_ratio, _, _ = ratio_norm_log_ratio(old_lp, lp, rollout_mean + dmu, rollout_mean, std, reduce)
    torch.testing.assert_close(log_ratio, (z * dmu).mean(dim=(1, 2, 3)), rtol=1e-4, atol=2e-6)


def test_no_bias_where_the_plain_ratios_mean_is_below_one():
    """A Gaussian policy of D = 256 dims and std s = 0.05 whose mean moved by dmu (|dmu| = 0.02 in every dim), 4000
    next latents drawn from the rollout (old) policy. Compared: the plain per-step ratio of our default log-prob
    (the mean over the latent dims), r = exp(d), d = l_theta - l_rollout, and RatioNorm's rho_hat, on

      * the log-ratio's mean: E[d] = -b = -mean(dmu^2) / (2 s^2) = -0.08;  E[log rho_hat] = 0;
      * the ratio's mean: E[r] = exp(-b + Var(d) / 2) = exp(-0.08 + 0.025^2 / 2) = 0.9234;
        E[rho_hat] = exp(mean(dmu^2) / (2 D)) = 1 + 8e-7;
      * the clip's two sides at eps = 0.002: r falls below 1 - eps with P = Phi(3.1) = 0.999 and above 1 + eps with
        P = Phi(-3.3) = 0.0005, while rho_hat (std 0.00125) leaves the band on each side equally often, Phi(-1.6) = 0.055.
    """
    g = torch.Generator().manual_seed(2)
    n, dims, s = 4000, 256, 0.05
    rollout_mean = torch.randn(1, dims, generator=g).expand(n, dims)
    dmu = 0.02 * torch.sign(torch.randn(1, dims, generator=g)).expand(n, dims)
    x = rollout_mean + s * torch.randn(n, dims, generator=g)
    std = torch.full((n,), s)
    old_lp, lp = gaussian_log_prob(x, rollout_mean, std), gaussian_log_prob(x, rollout_mean + dmu, std)
    log_hat, d, b = ratio_norm_log_ratio(old_lp, lp, rollout_mean + dmu, rollout_mean, std)
    torch.testing.assert_close(b, torch.full((n,), 0.08))
    assert float(d.mean()) == pytest.approx(-0.08, abs=2e-3)  # standard error 0.025 / sqrt(4000) = 4e-4
    assert float(d.exp().mean()) == pytest.approx(math.exp(-0.08 + 0.025**2 / 2), abs=2e-3)
    assert abs(float(log_hat.mean())) < 1e-4  # standard error 0.00125 / sqrt(4000) = 2e-5
    assert float(log_hat.exp().mean()) == pytest.approx(1.0, abs=1e-4)
    assert float(log_hat.std()) == pytest.approx(0.00125, rel=0.05)
    eps = 0.002
    plain_below, plain_above = float((d.exp() < 1 - eps).float().mean()), float((d.exp() > 1 + eps).float().mean())
    hat_below, hat_above = float((log_hat.exp() < 1 - eps).float().mean()), float((log_hat.exp() > 1 + eps).float().mean())
    assert plain_below > 0.99 and plain_above < 0.002
    assert hat_below == pytest.approx(0.055, abs=0.015) and hat_above == pytest.approx(0.055, abs=0.015)


def test_the_aggregated_loss_is_the_weighted_matrix_and_the_registration_declares_the_means():
    spec = get_policy_loss("ratio_norm")
    assert spec.needs_rollout_means and spec.per_step and spec.fn is ratio_norm_policy_loss.fn
    assert not get_policy_loss("vanilla").needs_rollout_means
    g = torch.Generator().manual_seed(3)
    rollout_mean, dmu = torch.randn(2, 3, 5, generator=g), 0.05 * torch.randn(2, 3, 5, generator=g)
    std = torch.tensor([[0.5, 0.3, 0.1], [0.5, 0.3, 0.1]])
    x = rollout_mean + std[..., None] * torch.randn(2, 3, 5, generator=g)
    old_lp = gaussian_log_prob(x.flatten(0, 1), rollout_mean.flatten(0, 1), std.flatten()).view(2, 3)
    lp = gaussian_log_prob(x.flatten(0, 1), (rollout_mean + dmu).flatten(0, 1), std.flatten()).view(2, 3)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    kwargs = dict(mean=rollout_mean + dmu, rollout_mean=rollout_mean, std=std, step_length=torch.full((2, 3), 0.25))
    loss, _ = spec(old_lp, lp, torch.ones(2, 3), aggregation_weights(mask, "step-mean"), clip_low=0.2, clip_high=0.2,
                   clip_ratio_c=3.0, **kwargs)
    mat = torch.stack([ratio_norm_policy_loss(old_lp, lp, torch.ones(2, 3), one_hot.view(2, 3), clip_low=0.2,
                                              clip_high=0.2, clip_ratio_c=3.0, **kwargs)[0] for one_hot in torch.eye(6)])
    torch.testing.assert_close(loss, (mat.view(2, 3) * mask).sum() / mask.sum())


def test_keywords_are_checked_and_missing_inputs_are_named():
    assert ratio_norm_config_errors({}) == [] and ratio_norm_config_errors({"reweight": "none"}) == []
    assert ratio_norm_config_errors({"reweight": "sqrt", "scale": 2}) == [
        "algorithm.policy_loss_kwargs.scale: ratio_norm takes no keyword 'scale'; its keywords: ['reweight']",
        "algorithm.policy_loss_kwargs.reweight='sqrt' must be one of ('dt', 'none') ('dt': GRPO-Guard's weight "
        "1 / step length; 'none': weight 1)",
    ]
    lp = torch.zeros(2)
    with pytest.raises(ValueError, match=r"ratio_norm needs mean, rollout_mean and std"):
        ratio_norm_policy_loss(lp, lp, lp, torch.ones(2), clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    with pytest.raises(ValueError, match=r"reweight='dt' needs the step's length"):
        ratio_norm_policy_loss(lp, lp, lp, torch.ones(2), clip_low=0.2, clip_high=0.2, mean=torch.zeros(2, 3),
                               rollout_mean=torch.zeros(2, 3), std=torch.ones(2), clip_ratio_c=3.0)


def test_a_wrong_keyword_is_a_config_error():
    from config.base import get_config
    from ddpo_group.run.config_checks import algorithm_errors

    config = get_config("grpo")
    config.algorithm.policy_loss = "ratio_norm"
    assert algorithm_errors(config) == []
    config.algorithm.policy_loss_kwargs = {"reweight": "none", "sigma": 1.0}
    assert "algorithm.policy_loss_kwargs.sigma: ratio_norm takes no keyword 'sigma'; its keywords: ['reweight']" in (
        algorithm_errors(config))
