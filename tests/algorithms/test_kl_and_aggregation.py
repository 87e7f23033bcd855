"""Aggregation modes, Gaussian KL, log-prob KL estimators, KL controllers, value loss."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ddpo_group.algorithms import (
    AGG_ALIASES,
    AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    aggregation_weights,
    clipped_value_loss,
    gaussian_kl,
    get_kl_controller,
    get_kl_kind,
)

D = torch.float64
L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=D)
M = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=D)  # the empty third row is not a trajectory


@pytest.mark.parametrize("mode,expected", [
    ("step-mean", (1 + 2 + 4) / 3),
    ("traj-mean-step-sum", (3 + 4) / 2),
    ("traj-mean-step-mean", (1.5 + 4) / 2),
    ("traj-mean-step-sum-norm", (3 + 4) / (2 * 3)),
])
def test_agg_modes_hand(mode, expected):
    assert math.isclose(float(agg_loss(L, M, mode)), expected, rel_tol=1e-12)
    alias = {v: k for k, v in AGG_ALIASES.items()}[mode]
    assert math.isclose(float(agg_loss(L, M, alias)), expected, rel_tol=1e-12)


def test_agg_unknown_mode_and_edge_cases():
    with pytest.raises(ValueError) as e:
        agg_loss(L, M, "sum")
    for m in AGG_MODES:
        assert m in str(e.value)
    for m in AGG_MODES:
        assert float(agg_loss(L, torch.zeros_like(M), m)) == 0.0  # empty mask: 0, not NaN
        nan_l = L.clone()
        nan_l[M == 0] = float("nan")
        assert math.isfinite(float(agg_loss(nan_l, M, m)))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 10_000),
       st.sampled_from(list(AGG_MODES) + list(AGG_ALIASES)))
def test_agg_equals_weighted_sum(B, T, seed, mode):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, dtype=D, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.6).to(D)
    w = aggregation_weights(mask, mode, dtype=D)
    assert torch.all(w[mask == 0] == 0)
    torch.testing.assert_close(agg_loss(loss, mask, mode), (w * loss).sum())
    if mask.sum() > 0:  # weights of a constant loss sum to the constant (a proper average) ...
        s = float(w.sum())
        if mode in ("step-mean", "token-mean", "traj-mean-step-mean", "seq-mean-token-mean"):
            assert math.isclose(s, 1.0, rel_tol=1e-12)


# ------------------------------------------------------------------------------------ Gaussian KL
def test_gaussian_kl_hand_and_zero():
    mu = torch.zeros(2, 1, 2, 2, dtype=D)
    ref = mu.clone()
    ref[0] += 1.0
    kl = gaussian_kl(mu, ref, 0.5)
    torch.testing.assert_close(kl, torch.tensor([1.0 / (2 * 0.25), 0.0], dtype=D))
    torch.testing.assert_close(gaussian_kl(mu, ref, 0.5, reduce="sum"), torch.tensor([8.0, 0.0], dtype=D))
    assert torch.all(gaussian_kl(ref, ref, torch.tensor([0.3, 0.7], dtype=D)) == 0)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(1, 3), min_size=0, max_size=3), st.integers(0, 10_000),
       st.sampled_from(["mean", "sum"]), st.sampled_from(["scalar", "per_sample"]))
def test_gaussian_kl_matches_torch_distributions(N, dims, seed, reduce, std_kind):
    g = torch.Generator().manual_seed(seed)
    shape = (N, *dims)
    mp = torch.randn(shape, dtype=D, generator=g)
    mr = torch.randn(shape, dtype=D, generator=g)
    if std_kind == "scalar":
        std = 0.1 + float(torch.rand(1, generator=g))
        std_full = torch.full(shape, std, dtype=D)
    else:
        std = 0.1 + torch.rand(N, dtype=D, generator=g)
        std_full = std.reshape((N,) + (1,) * len(dims)).expand(shape)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mp, std_full),
                                            torch.distributions.Normal(mr, std_full))
    if len(dims):
        ref = ref.mean(dim=tuple(range(1, len(shape)))) if reduce == "mean" else ref.sum(dim=tuple(range(1, len(shape))))
    torch.testing.assert_close(gaussian_kl(mp, mr, std, reduce=reduce), ref)
    assert torch.all(gaussian_kl(mp, mp, std, reduce=reduce) == 0)


# ------------------------------------------------------------------------------ log-prob KL
def kl_penalty(log_prob, ref_log_prob, kind):
    """The KL kind ``kind`` on two step outputs that differ in their log-probs only (as KLRegularizer calls it)."""
    return get_kl_kind(kind)(SimpleNamespace(log_prob=log_prob), SimpleNamespace(log_prob=ref_log_prob))


def test_kl_penalty_kinds():
    lp = torch.tensor([math.log(2.0), 0.0], dtype=D)
    ref = torch.zeros(2, dtype=D)
    d = math.log(2.0)
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([d, 0.0], dtype=D))
    torch.testing.assert_close(kl_penalty(lp, ref, "kl"), kl_penalty(lp, ref, "k1"))
    torch.testing.assert_close(kl_penalty(-lp, ref, "abs"), torch.tensor([d, 0.0], dtype=D))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.5 * d * d, 0.0], dtype=D))
    torch.testing.assert_close(kl_penalty(lp, ref, "mse"), kl_penalty(lp, ref, "k2"))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([0.5 + d - 1.0, 0.0], dtype=D))
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), kl_penalty(lp, ref, "k3"))
    big = kl_penalty(torch.tensor([-50.0], dtype=D), torch.tensor([0.0], dtype=D), "k3")
    assert float(big) == 10.0  # clamped
    x = torch.randn(100, dtype=D, generator=torch.Generator().manual_seed(0))
    k3 = kl_penalty(x, torch.zeros_like(x), "k3")
    torch.testing.assert_close(k3, (torch.exp(-x) + x - 1).clamp(max=10.0))  # d = x; one of them reaches the clamp
    assert bool((k3 > 0).all())  # exp(-d) + d - 1 > 0 for every d != 0
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(lp, ref, "k4")


def test_kl_controllers():
    c = AdaptiveKLController(0.1, target_kl=1.0, horizon=10)
    assert math.isclose(c.update(2.0, 5), 0.1 * (1 + 0.2 * 5 / 10))      # above target: beta up (error clipped)
    c2 = AdaptiveKLController(0.1, target_kl=1.0, horizon=10)
    assert math.isclose(c2.update(0.9, 10), 0.1 * (1 - 0.1))            # below target: beta down
    c3 = AdaptiveKLController(1.0, target_kl=0.5, horizon=100)
    c3.load_state_dict(c.state_dict())
    assert c3.value == c.value and c3.target_kl == 1.0 and c3.horizon == 10
    f = FixedKLController(0.3)
    f.update(100.0, 1000)
    assert f.value == 0.3
    assert isinstance(get_kl_controller("adaptive", 0.1, 1.0, 10), AdaptiveKLController)
    with pytest.raises(ValueError):
        get_kl_controller("pid", 0.1)


# ------------------------------------------------------------------------------------ value loss
def test_clipped_value_loss_hand():
    v = torch.tensor([[1.5, 1.1, float("nan")]], dtype=D)
    old = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    y = torch.tensor([[2.0, 2.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]], dtype=D)
    # v=1.5 clipped to 1.2: max(0.25, 0.64) = 0.64; v=1.1 inside: 0.81
    loss, m = clipped_value_loss(v, old, y, mask, clip_range=0.2)
    assert math.isclose(float(loss), 0.5 * (0.64 + 0.81) / 2, rel_tol=1e-12)
    assert math.isclose(m["critic/clipfrac"], 0.5)
    loss, m = clipped_value_loss(v, old, y, mask, clip_range=None)
    assert math.isclose(float(loss), 0.5 * (0.25 + 0.81) / 2, rel_tol=1e-12)
    assert m["critic/clipfrac"] == 0.0
    loss, _ = clipped_value_loss(v, old, y, mask, 0.2, loss_agg_mode="traj-mean-step-sum")
    assert math.isclose(float(loss), 0.5 * (0.64 + 0.81), rel_tol=1e-12)


def test_clipped_value_loss_masked_nan_has_no_gradient_and_empty_rows_count_nothing():
    v = torch.tensor([[1.5, float("nan")], [float("nan"), float("nan")]], dtype=D, requires_grad=True)
    old = torch.tensor([[1.0, float("nan")], [0.0, 0.0]], dtype=D)
    y = torch.tensor([[2.0, float("nan")], [0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 0], [0, 0]], dtype=D)  # the second trajectory has no critic target
    loss, m = clipped_value_loss(v, old, y, mask, clip_range=0.2)
    loss.backward()
    assert math.isclose(float(loss), 0.5 * 0.64, rel_tol=1e-12) and m["critic/value_loss"] == float(loss)
    # d/dv of 0.5 (v_clip - y)^2 is 0 where the clip is active; every other entry is masked
    assert torch.equal(v.grad, torch.zeros_like(v))
    v2 = torch.tensor([[1.1, float("nan")], [float("nan"), 3.0]], dtype=D, requires_grad=True)
    clipped_value_loss(v2, old, y, mask, clip_range=0.2)[0].backward()
    assert torch.allclose(v2.grad, torch.tensor([[1.1 - 2.0, 0.0], [0.0, 0.0]], dtype=D))
