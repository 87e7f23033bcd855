"""Policy losses: hand-computed values, metrics, gradient direction, chunking, registry."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ddpo_group.algorithms import (
    POLICY_LOSS_REGISTRY,
    aggregation_weights,
    get_policy_loss,
    register_policy_loss,
    vanilla_policy_loss,
)

D = torch.float64


def lp(ratios):
    return torch.log(torch.tensor(ratios, dtype=D))


def vanilla_terms(old, new, A, mask, **clip):
    """Each pair's term L of vanilla's loss (the loss with that pair's weight 1 and every other's 0), and the metrics
    over the pairs of ``mask``."""
    flat = [x.reshape(-1) for x in (old, new, A)]
    one_hot = torch.eye(flat[0].numel(), dtype=D)
    terms = torch.stack([vanilla_policy_loss(*flat, one_hot[i], **clip)[0] for i in range(len(one_hot))])
    _, metrics = vanilla_policy_loss(old, new, A, mask.to(D), **clip)
    return terms.view(old.shape), metrics


def aggregated(name, old, new, A, mask, mode, **clip):
    """A registered loss on [B, T] matrices aggregated with ``mode``: a per-step loss through the mode's weights."""
    spec = get_policy_loss(name)
    if spec.per_step:
        return spec(old, new, A, aggregation_weights(mask, mode, dtype=D), **clip)
    return spec(old, new, A, mask, mode, **clip)


def test_vanilla_hand():
    # ratios and advantages per step; clip_low 0.2, clip_high 0.2, dual clip c = 3
    ratios = [[1.5, 1.5, 5.0], [0.5, 0.5, 1.0]]
    A = torch.tensor([[1.0, -1.0, -1.0], [1.0, -1.0, 2.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    old = torch.zeros(2, 3, dtype=D)
    new = lp(ratios)
    # step losses: A=1,r=1.5 -> max(-1.5,-1.2) = -1.2 (clipped); A=-1,r=1.5 -> 1.5;
    # A=-1,r=5 -> max(5, 1.2) = 5 -> dual clip min(5, 3) = 3; A=1,r=0.5 -> max(-0.5,-0.8) = -0.5;
    # A=-1,r=0.5 -> max(0.5, 0.8) = 0.8 (clipped); masked step ignored.
    expected = [[-1.2, 1.5, 3.0], [-0.5, 0.8, -2.0]]
    mat, _ = vanilla_terms(old, new, A, mask, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    torch.testing.assert_close(mat, torch.tensor(expected, dtype=D))
    loss, metrics = aggregated("vanilla", old, new, A, mask, "step-mean", clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    assert math.isclose(float(loss), (-1.2 + 1.5 + 3.0 - 0.5 + 0.8) / 5, rel_tol=1e-12)
    assert math.isclose(metrics["clipfrac"], 2 / 5)  # (A=1,r=1.5), (A=-1,r=0.5); r=5 is dual-clipped
    assert math.isclose(metrics["clipfrac_lower"], 1 / 5)
    assert math.isclose(metrics["ratio_max"], 5.0) and math.isclose(metrics["ratio_min"], 0.5)
    assert math.isclose(metrics["ratio_mean"], (1.5 + 1.5 + 5 + 0.5 + 0.5) / 5)
    d = torch.log(torch.tensor([1.5, 1.5, 5.0, 0.5, 0.5], dtype=D))
    assert math.isclose(metrics["approx_kl"], float((0.5 * d ** 2).mean()))
    assert math.isclose(metrics["ppo_kl"], float((-d).mean()))
    # other aggregation: traj-mean-step-sum = ((-1.2 + 1.5 + 3) + (-0.5 + 0.8)) / 2
    loss, _ = aggregated("vanilla", old, new, A, mask, "seq-mean-token-sum", clip_low=0.2, clip_high=0.2,
                         clip_ratio_c=3.0)
    assert math.isclose(float(loss), (3.3 + 0.3) / 2, rel_tol=1e-12)


def test_vanilla_asymmetric_and_no_dual_clip():
    old = torch.zeros(1, 2, dtype=D)
    new = lp([[1.5, 0.5]])
    A = torch.tensor([[1.0, -1.0]], dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    mat, _ = vanilla_terms(old, new, A, mask, clip_low=0.1, clip_high=0.3, clip_ratio_c=3.0)
    torch.testing.assert_close(mat, torch.tensor([[-1.3, 0.9]], dtype=D))
    new = lp([[1.0, 10.0]])
    mat, _ = vanilla_terms(old, new, A, mask, clip_low=0.1, clip_high=0.3, clip_ratio_c=None)
    torch.testing.assert_close(mat, torch.tensor([[-1.0, 10.0]], dtype=D))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        vanilla_policy_loss(old, new, A, mask, clip_low=0.1, clip_high=0.3, clip_ratio_c=0.5)


def test_log_ratio_clamp():
    old = torch.zeros(1, 1, dtype=D)
    new = torch.full((1, 1), 100.0, dtype=D)
    _, m = vanilla_policy_loss(old, new, torch.ones(1, 1, dtype=D), torch.ones(1, 1, dtype=D), clip_low=0.2,
                               clip_high=0.2, clip_ratio_c=3.0)
    assert math.isclose(m["ratio_max"], math.exp(20.0))


def test_gspo_hand():
    old = torch.zeros(1, 2, dtype=D)
    new = lp([[1.1, 1.3]]).requires_grad_(True)
    A = torch.ones(1, 2, dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    s = math.sqrt(1.1 * 1.3)  # geometric mean ratio 1.19583
    loss, m = get_policy_loss("gspo")(old, new, A, mask, "traj-mean-step-mean",
                                      clip_low=0.1, clip_high=0.1, clip_ratio_c=3.0)
    assert math.isclose(float(loss.detach()), -1.1, rel_tol=1e-12)  # clipped to 1 + 0.1
    assert m["clipfrac"] == 1.0 and math.isclose(m["traj_ratio_mean"], s, rel_tol=1e-12)
    loss, m = get_policy_loss("gspo")(old, new, A, mask, "traj-mean-step-mean",
                                      clip_low=0.3, clip_high=0.3, clip_ratio_c=3.0)
    assert math.isclose(float(loss.detach()), -s, rel_tol=1e-12)
    loss.backward()
    # d loss / d l_n = -A * s / T (each step's gradient carries the trajectory ratio)
    torch.testing.assert_close(new.grad, torch.full((1, 2), -s / 2, dtype=D))


def test_geo_mean_hand():
    old = torch.zeros(2, 2, dtype=D)
    new = torch.tensor([[0.1, -0.05], [0.1, -0.05]], dtype=D)
    A = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=D)
    mask = torch.ones(2, 2, dtype=D)
    loss, m = get_policy_loss("geo_mean")(old, new, A, mask, "step-mean",
                                          clip_low=0.08, clip_high=0.08, clip_ratio_c=3.0)
    # A > 0: d~ = [min(0.1, 0.08), -0.05] -> mean 0.015; A < 0: d~ = [0.1, max(-0.05, -0.05)] -> 0.025
    expected = 0.5 * (-math.exp(0.015) + math.exp(0.025))
    assert math.isclose(float(loss), expected, rel_tol=1e-12)
    assert math.isclose(m["clipfrac"], 1 / 4)
    # A < 0, d = -0.1 below -clip_low is floored at -0.08
    loss, _ = get_policy_loss("geo_mean")(old[:1], torch.tensor([[-0.1, 0.0]], dtype=D),
                                          -torch.ones(1, 2, dtype=D), mask[:1], "step-mean",
                                          clip_low=0.08, clip_high=0.08, clip_ratio_c=3.0)
    assert math.isclose(float(loss), math.exp(-0.04), rel_tol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 4), st.integers(1, 5), st.integers(0, 10_000),
    st.sampled_from(["vanilla", "gspo", "geo_mean"]),
    st.sampled_from(["step-mean", "traj-mean-step-sum", "traj-mean-step-mean", "traj-mean-step-sum-norm"]),
)
def test_gradient_direction(B, T, seed, name, mode):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, dtype=D, generator=g)
    new = old.clone().requires_grad_(True)  # ratio 1: inside every clip range
    A = torch.randn(B, 1, dtype=D, generator=g).expand(B, T).contiguous()
    mask = (torch.rand(B, T, generator=g) < 0.7).to(D)
    loss, metrics = aggregated(name, old, new, A, mask, mode, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    loss.backward()
    grad = new.grad
    on = (mask > 0) & (A != 0)
    # increasing the log-prob of a positive-advantage step lowers the loss, and vice versa
    assert torch.all(torch.sign(grad[on]) == -torch.sign(A[on]))
    assert torch.all(grad[mask == 0] == 0)
    assert metrics["clipfrac"] == 0.0
    if on.any():  # a finite step in that direction lowers the loss
        i, j = [int(x) for x in on.nonzero()[0]]
        bumped = new.detach().clone()
        bumped[i, j] += 1e-3 * float(torch.sign(A[i, j]))
        loss2, _ = aggregated(name, old, bumped, A, mask, mode, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
        assert float(loss2) < float(loss.detach())


def test_vanilla_chunked_matches_full():
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    old = torch.randn(B, T, dtype=D, generator=g)
    new = old + 0.3 * torch.randn(B, T, dtype=D, generator=g)
    A = torch.randn(B, T, dtype=D, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.6).to(D)
    for mode in ("token-mean", "seq-mean-token-mean", "traj-mean-step-sum", "traj-mean-step-sum-norm"):
        full, _ = aggregated("vanilla", old, new, A, mask, mode, clip_low=0.1, clip_high=0.2, clip_ratio_c=3.0)
        w = aggregation_weights(mask, mode, dtype=D).reshape(-1)
        flat = [x.reshape(-1) for x in (old, new, A)]
        total = 0.0
        for s in range(0, B * T, 5):  # chunks of flattened (sample, step) pairs, as the update runs them
            chunk = [x[s:s + 5] for x in flat]
            loss, _ = vanilla_policy_loss(*chunk, w[s:s + 5], clip_low=0.1, clip_high=0.2, clip_ratio_c=3.0)
            total = total + loss
        assert math.isclose(float(total), float(full), rel_tol=1e-12, abs_tol=1e-14)


def test_policy_loss_registry():
    with pytest.raises(ValueError) as e:
        get_policy_loss("ppo2")
    for name in ("vanilla", "gspo", "geo_mean"):
        assert name in str(e.value) and name in POLICY_LOSS_REGISTRY
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a, **k: None)
    # extra kwargs are ignored
    x = torch.zeros(1, 1, dtype=D)
    get_policy_loss("vanilla")(x, x, x + 1, x + 1, clip_low=0.1, clip_high=0.1, foo=1, clip_ratio_c=3.0)
