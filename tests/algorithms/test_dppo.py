"""Flow-DPPO's loss (algorithms/policy_losses.py, ``dppo``): the exact step KL, the asymmetric mask by hand, no
gradient through a blocked pair, the registration, and its bound in the on-policy measures."""

import math

import pytest
import torch

from config.base import get_config
from ddpo_group.algorithms import get_policy_loss
from ddpo_group.algorithms.policy_losses import dppo_config_errors, dppo_kl, dppo_policy_loss, outside_kl_bound

D = torch.float64


def pairs(mean_shift, log_ratio, advantages, std=0.5):
    """Four pairs of 2 latent dims: their means moved by ``mean_shift`` (the KL is then shift^2 / (2 std^2)), their
    log-ratios and advantages."""
    rollout_mean = torch.zeros(4, 2, dtype=D)
    mean = rollout_mean + torch.tensor(mean_shift, dtype=D)[:, None]
    old_lp = torch.zeros(4, dtype=D)
    lp = torch.tensor(log_ratio, dtype=D).requires_grad_(True)
    return dict(rollout_log_prob=old_lp, log_prob=lp, advantages=torch.tensor(advantages, dtype=D), mean=mean,
                rollout_mean=rollout_mean, std=torch.full((4,), std, dtype=D))


def test_the_step_kl_is_the_gaussians_closed_form():
    args = pairs([0.0, 0.1, 0.2, 0.3], [0, 0, 0, 0], [1, 1, 1, 1])
    kl = dppo_kl(args["mean"], args["rollout_mean"], args["std"])
    torch.testing.assert_close(kl, torch.tensor([0.0, 0.02, 0.08, 0.18], dtype=D))  # shift^2 / (2 * 0.25)
    assert dppo_kl(args["mean"], args["rollout_mean"], args["std"], "sum")[3] == pytest.approx(0.36)  # 2 dims summed


def test_the_mask_blocks_only_pairs_beyond_the_threshold_that_move_away():
    """Threshold 0.05 (pairs 2 and 3 beyond it). Pair 2: r > 1, A > 0 (away): blocked. Pair 3: r < 1, A > 0 (pulled
    back): kept. Pairs 0 and 1 within it: kept whatever the ratio (no clip: r = e^0.5)."""
    args = pairs([0.0, 0.1, 0.2, 0.3], [0.5, -0.5, 0.3, -0.3], [1.0, -1.0, 2.0, 2.0])
    weights = torch.full((4,), 0.25, dtype=D)
    loss, metrics = dppo_policy_loss(**args, weights=weights, policy_kl_threshold=0.05)
    r = [math.exp(v) for v in (0.5, -0.5, 0.3, -0.3)]
    want = 0.25 * (-1.0 * r[0] + 1.0 * r[1] + 0.0 - 2.0 * r[3])  # pair 2 contributes nothing
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert metrics["clipfrac"] == 0.25 and metrics["kl_over"] == 0.5 and metrics["kl_max"] == pytest.approx(0.18)
    loss.backward()
    grad = args["log_prob"].grad
    assert grad[2] == 0  # blocked: no gradient
    assert grad[0] == pytest.approx(-0.25 * r[0]) and grad[3] == pytest.approx(-0.25 * 2.0 * r[3])
    # negative advantage moving down (away) beyond the threshold: blocked too
    args = pairs([0.3, 0.3, 0.3, 0.3], [-0.2, 0.2, -0.2, 0.2], [-1.0, -1.0, 1.0, 1.0])
    _, metrics = dppo_policy_loss(**args, weights=torch.ones(4, dtype=D), policy_kl_threshold=0.05)
    assert metrics["clipfrac"] == 0.5  # pairs 0 (r < 1, A < 0) and 3 (r > 1, A > 0)


def test_at_the_rollout_policy_nothing_is_blocked_and_the_gradient_is_the_policy_gradient():
    args = pairs([0.0] * 4, [0.0] * 4, [1.0, -1.0, 0.5, 2.0])
    loss, metrics = dppo_policy_loss(**args, weights=torch.full((4,), 0.25, dtype=D), policy_kl_threshold=1e-5)
    loss.backward()
    torch.testing.assert_close(args["log_prob"].grad, -0.25 * args["advantages"])  # d(-A r)/dl = -A at r = 1
    assert metrics["clipfrac"] == 0.0 and metrics["kl_max"] == 0.0


def test_the_registration_the_keywords_and_the_bound():
    spec = get_policy_loss("dppo")
    assert spec.per_step and spec.needs_rollout_means and spec.trust_region is outside_kl_bound
    # the messages that judge the trust region (scripts/check.py's verdict, the on-policy warning) name its field
    config = get_config("grpo")
    assert spec.trust_region_fields(config) == "train.policy_kl_threshold=1e-05"
    assert get_policy_loss("vanilla").trust_region_fields(config) == "train.clip_range=0.0001"
    assert dppo_config_errors({}) == []
    assert dppo_config_errors({"policy_kl_threshold": 1.0}) == [
        "algorithm.policy_loss_kwargs.policy_kl_threshold: dppo takes no keyword 'policy_kl_threshold'; its threshold is "
        "train.policy_kl_threshold"]
    args = pairs([0.0, 0.1, 0.2, 0.3], [0, 0, 0, 0], [1, 1, 1, 1])
    outside = outside_kl_bound(args["rollout_log_prob"], args["log_prob"], policy_kl_threshold=0.05, mean=args["mean"],
                               rollout_mean=args["rollout_mean"], std=args["std"])
    assert outside.tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="dppo needs mean, rollout_mean and std"):
        dppo_policy_loss(args["rollout_log_prob"], args["log_prob"], args["advantages"], torch.ones(4),
                         policy_kl_threshold=0.1)


def test_the_bound_counts_the_pairs_the_mask_blocks():
    """Every pair beyond the threshold, two of them moving back toward the rollout policy (ratio and advantage of
    opposite signs): the mask blocks the other two, and the on-policy count says two, not four."""
    args = pairs([0.1] * 4, [0.5, -0.5, 0.5, -0.5], [1.0, 1.0, -1.0, -1.0])  # KL 0.02 each
    bounds = dict(policy_kl_threshold=1e-3, mean=args["mean"], rollout_mean=args["rollout_mean"], std=args["std"])
    assert outside_kl_bound(args["rollout_log_prob"], args["log_prob"], **bounds).tolist() == [True] * 4
    blocked = outside_kl_bound(args["rollout_log_prob"], args["log_prob"], **bounds, advantages=args["advantages"])
    assert blocked.tolist() == [True, False, False, True]  # r > 1 with A > 0, r < 1 with A < 0
    _, metrics = dppo_policy_loss(**args, weights=torch.full((4,), 0.25, dtype=D), **{
        k: v for k, v in bounds.items() if k not in ("mean", "rollout_mean", "std")})
    assert metrics["clipfrac"] == 0.5 and metrics["kl_over"] == 1.0
