"""GROUP_PPO: hand case, loop reference, exact limits of GROUP_PPO.md section 7, controller."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ddpo_group.algorithms import (
    AdvantageInputs,
    GroupThresholdController,
    find_segment_endpoints,
    get_adv_estimator,
    group_ppo_from_values,
    post_step_values,
    segment_metrics,
    td_deltas,
)
from helpers.estimator_params import params as estimator_params

D = torch.float64
EPS = 1e-6

# 1 prompt x 2 samples x 3 steps. values are pre-step: column 0 (V(x_0)) is not used by GROUP_PPO.
R1 = torch.tensor([1.0, 0.0], dtype=D)
V1 = torch.tensor([[0.3, 0.9, 0.95], [0.7, 0.1, 0.05]], dtype=D)
GI1 = torch.tensor([0, 0])
# u = [[0.9, 0.95, 1], [0.1, 0.05, 0]], b = 0.5, delta = [[0.4, 0.05, 0.05], [-0.4, -0.05, -0.05]]
# rho(0,1) = (2*2*0.45^2) / (2*(0.16+0.0025)) = 0.81 / 0.325 = 2.49
# rho(0,2) = (3*2*0.25) / (2*(0.16+0.0025+0.0025)) = 1.5 / 0.33 = 4.55
# rho(1,2) = (2*2*0.01) / (2*(0.0025+0.0025)) = 0.04 / 0.01 = 4


def est(R, V, gi, mask=None, **kw):
    mask = torch.ones(V.shape, dtype=D) if mask is None else mask
    return get_adv_estimator("group_ppo")(AdvantageInputs(R, mask, gi, values=V), **estimator_params("group_ppo", **kw))


def test_hand_case_endpoints_advantages_critic():
    # tau = 3: no cut at n = 1 (2.49), cut at n = 2 (4.55): groups [0, 1], [2]
    out = est(R1, V1, GI1, tau=3.0, gae_lambda=1.0)
    assert out.extras["step_endpoints"].tolist() == [[False, True, True]] * 2
    # lam = 1: group 1 -> R - b = +-0.5, group 2 -> R - u_1 = [0.05, -0.05]
    torch.testing.assert_close(out.advantages, torch.tensor([[0.5, 0.5, 0.05], [-0.5, -0.5, -0.05]], dtype=D))
    # critic: one target per trajectory at pre-step column e_1 + 1 = 2 (latent x_2), y = R
    assert out.endpoint_mask.tolist() == [[0, 0, 1], [0, 0, 1]]
    torch.testing.assert_close(out.critic_targets, torch.tensor([[0, 0, 1.0], [0, 0, 0.0]], dtype=D))
    m = out.metrics
    assert m["segment/num_endpoints"] == 2 and m["segment/mean_len"] == 1.5 and m["segment/tau"] == 3.0
    assert math.isclose(m["segment/compression_ratio"], 1 - 2 / 3)
    assert math.isclose(m["segment/rho_at_cut"], (1.5 + EPS) / (0.33 + EPS), rel_tol=1e-12)
    # lam = 0: A = Delta: group 1 -> u_1 - b = +-0.45; lam = 0.5: 0.45 + 0.5 * 0.05
    out0 = est(R1, V1, GI1, tau=3.0, gae_lambda=0.0)
    torch.testing.assert_close(out0.advantages, torch.tensor([[0.45, 0.45, 0.05], [-0.45, -0.45, -0.05]], dtype=D))
    out5 = est(R1, V1, GI1, tau=3.0, gae_lambda=0.5)
    torch.testing.assert_close(out5.advantages[:, 0], torch.tensor([0.475, -0.475], dtype=D))
    # std scaling by std_g(R) = sqrt(0.5) (Bessel), critic targets unscaled
    outs = est(R1, V1, GI1, tau=3.0, gae_lambda=1.0, norm_adv_by_std=True)
    torch.testing.assert_close(outs.advantages, out.advantages / (math.sqrt(0.5) + EPS))
    torch.testing.assert_close(outs.critic_targets, out.critic_targets)
    # tau = 2 cuts everywhere, tau = 5 never
    assert est(R1, V1, GI1, tau=2.0).extras["step_endpoints"].all()
    assert est(R1, V1, GI1, tau=5.0).extras["step_endpoints"].tolist() == [[False, False, True]] * 2
    # the mask only zeroes advantages; endpoints do not move
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=D)
    outm = est(R1, V1, GI1, mask, tau=3.0)
    torch.testing.assert_close(outm.advantages, out.advantages * mask)
    torch.testing.assert_close(outm.endpoint_mask, out.endpoint_mask)


# ------------------------------------------------------------------------------ loop reference
def ref_group_ppo(u, b, gi, tau, max_size, eps, lam, w=None):
    """Plain-Python transcription of GROUP_PPO.md sections 2-4 (per prompt group)."""
    B, T = len(u), len(u[0])
    w = w or [[1.0] * T for _ in range(B)]

    def uu(i, n):
        return b[i] if n == -1 else u[i][n]

    ends_of = {}
    for g in sorted(set(gi)):
        idx = [i for i in range(B) if gi[i] == g]
        a, ends = 0, []
        for n in range(T):
            if n > a:
                rg = sum(sum(w[i][a:n + 1]) * (uu(i, n) - uu(i, a - 1)) ** 2 for i in idx)
                rp = sum(sum(w[i][m] * (uu(i, m) - uu(i, m - 1)) ** 2 for m in range(a, n + 1)) for i in idx)
                if (rg + eps) / (rp + eps) > tau:
                    ends.append(n - 1)
                    a = n
            if n - a + 1 >= max_size or n == T - 1:
                ends.append(n)
                a = n + 1
        ends_of[g] = ends
    adv = [[0.0] * T for _ in range(B)]
    for i in range(B):
        e = [-1] + ends_of[gi[i]]
        K = len(e) - 1
        delta = [uu(i, e[k + 1]) - uu(i, e[k]) for k in range(K)]
        for k in range(K):
            A = sum(lam ** (j - k) * delta[j] for j in range(k, K))
            for n in range(e[k] + 1, e[k + 1] + 1):
                adv[i][n] = A
    return ends_of, adv


@st.composite
def problem(draw):
    P = draw(st.integers(1, 3))
    G = draw(st.integers(2, 4))
    T = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 100_000))
    g = torch.Generator().manual_seed(seed)
    gi = torch.arange(P).repeat_interleave(G)
    gi = gi[torch.randperm(P * G, generator=g)]
    R = torch.rand(P * G, dtype=D, generator=g)
    V = torch.rand(P * G, T, dtype=D, generator=g)
    if draw(st.booleans()):  # a critic that tracks the reward: long consistent-progress groups
        V = R[:, None] * torch.linspace(0, 1, T, dtype=D)[None, :] + 0.1 * V
    tau = draw(st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0, 10.0, math.inf]))
    max_size = draw(st.integers(1, T + 1))
    lam = draw(st.sampled_from([0.0, 0.5, 0.95, 1.0]))
    mask = (torch.rand(P * G, T, generator=g) < 0.7).to(D)
    return R, V, gi, tau, max_size, lam, mask


@settings(max_examples=60, deadline=None)
@given(problem(), st.booleans())
def test_vectorised_matches_loop_reference(prob, weighted):
    R, V, gi, tau, max_size, lam, mask = prob
    res = group_ppo_from_values(V, R, gi, tau=tau, max_segment_steps=max_size, numerical_floor=EPS, gae_lambda=lam,
                               step_mask=mask, weight_by_mask=weighted, norm_adv_by_std=False)
    u = post_step_values(V, R)
    b = [float(R[gi == gi[i]].mean()) for i in range(len(R))]
    ends, adv = ref_group_ppo(u.tolist(), b, gi.tolist(), tau, max_size, EPS, lam,
                              w=mask.tolist() if weighted else None)
    for i in range(len(R)):
        got = res.step_endpoints[i].nonzero().flatten().tolist()
        assert got == ends[int(gi[i])]
    torch.testing.assert_close(res.advantages, torch.tensor(adv, dtype=D), rtol=1e-9, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(problem())
def test_endpoint_invariants_and_critic_mask(prob):
    R, V, gi, tau, max_size, lam, mask = prob
    T = V.shape[1]
    out = est(R, V, gi, mask, tau=tau, max_segment_steps=max_size, gae_lambda=lam)
    ends = out.extras["step_endpoints"]
    for i in range(len(R)):
        e = ends[i].nonzero().flatten().tolist()
        assert e[-1] == T - 1
        assert all(x < y for x, y in zip(e, e[1:]))
        sizes = np.diff([-1] + e)
        assert sizes.min() >= 1 and sizes.max() <= max_size
        same = gi == gi[i]
        assert torch.equal(ends[same], ends[i].expand(int(same.sum()), T))  # a prompt's samples share them
    K = ends.sum(dim=1)
    assert torch.equal(out.endpoint_mask.sum(dim=1).long(), K - 1)
    assert torch.all(out.endpoint_mask[:, 0] == 0)
    assert torch.all(out.advantages[mask == 0] == 0)
    assert torch.isfinite(out.advantages).all()


# ------------------------------------------------------------------------------ exact limits
@settings(max_examples=40, deadline=None)
@given(problem())
def test_tau_zero_equals_gae(prob):
    R, V, gi, _, _, lam, mask = prob
    out = est(R, V, gi, mask, tau=0.0, gae_lambda=lam, max_segment_steps=1000)
    assert out.extras["step_endpoints"].all()  # every step is its own group
    inputs = AdvantageInputs(R, mask, gi, values=V)
    gae = get_adv_estimator("gae")(inputs, gamma=1.0, gae_lambda=lam, whiten=False, gae_start_value="group_mean")
    torch.testing.assert_close(out.advantages, gae.advantages, rtol=1e-9, atol=1e-12)
    # the same GAE on values_pre[:, n] = u[:, n-1], i.e. V(x_0) replaced by b_g by hand
    Vb = V.clone()
    Vb[:, 0] = torch.stack([R[gi == g].mean() for g in gi])
    gae2 = get_adv_estimator("gae")(AdvantageInputs(R, mask, gi, values=Vb), gamma=1.0, gae_lambda=lam, whiten=False,
                                    gae_start_value="critic")
    torch.testing.assert_close(out.advantages, gae2.advantages, rtol=1e-9, atol=1e-12)
    # critic targets at every post-step state = GAE returns (same lambda) on columns 1..T-1
    torch.testing.assert_close(out.critic_targets[:, 1:], gae.returns[:, 1:], rtol=1e-9, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(problem())
def test_tau_inf_equals_dr_grpo_and_grpo(prob):
    R, V, gi, _, _, lam, mask = prob
    T = V.shape[1]
    for max_size in (T, T + 5):
        out = est(R, V, gi, mask, tau=math.inf, max_segment_steps=max_size, gae_lambda=lam)
        assert out.extras["step_endpoints"].sum() == len(R)  # one group
        dr = get_adv_estimator("dr_grpo")(AdvantageInputs(R, mask, gi))
        torch.testing.assert_close(out.advantages, dr.advantages, rtol=1e-9, atol=1e-12)
        assert out.endpoint_mask.sum() == 0
        outs = est(R, V, gi, mask, tau=math.inf, max_segment_steps=max_size, gae_lambda=lam, norm_adv_by_std=True)
        grpo = get_adv_estimator("grpo")(AdvantageInputs(R, mask, gi), eps=EPS, norm_adv_by_std=True, global_std=False)
        torch.testing.assert_close(outs.advantages, grpo.advantages, rtol=1e-9, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(problem())
def test_residual_critic_is_the_plain_one_shifted_by_the_group_mean_and_grpo_at_zero(prob):
    R, V, gi, tau, max_size, lam, mask = prob
    b = torch.stack([R[gi == g].mean() for g in gi])
    kw = dict(tau=tau, max_segment_steps=max_size, gae_lambda=lam, norm_adv_by_std=True)
    residual = est(R, V, gi, mask, value_source="residual_critic", **kw)
    plain = est(R, V + b[:, None], gi, mask, **kw)  # the same values, given whole
    torch.testing.assert_close(residual.advantages, plain.advantages, rtol=1e-9, atol=1e-12)
    assert torch.equal(residual.extras["step_endpoints"], plain.extras["step_endpoints"])
    # the critic learns the deviation: its targets are the plain ones minus b_g at the endpoints, 0 elsewhere
    on = residual.endpoint_mask > 0
    torch.testing.assert_close(residual.critic_targets[on], (plain.critic_targets - b[:, None])[on], rtol=1e-9, atol=1e-12)
    assert torch.all(residual.critic_targets[~on] == 0)
    # an untrained residual critic (output 0) gives grpo's advantage on every step, whatever the grouping (lam = 1)
    zero = est(R, torch.zeros_like(V), gi, mask, value_source="residual_critic", **{**kw, "gae_lambda": 1.0})
    grpo = get_adv_estimator("grpo")(AdvantageInputs(R, mask, gi), eps=EPS, norm_adv_by_std=True, global_std=False)
    torch.testing.assert_close(zero.advantages, grpo.advantages, rtol=1e-9, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(problem(), st.sampled_from([0.0, 0.4, 1.0]))
def test_the_critic_weight_scales_the_residual_critic(prob, c):
    """critic_weight c: the residual critic enters as c f (at 0 grpo's advantages whatever f), a plain critic is not
    weighted (its output is the whole value, not a deviation)."""
    R, V, gi, tau, max_size, lam, mask = prob
    kw = dict(tau=tau, max_segment_steps=max_size, gae_lambda=lam, norm_adv_by_std=True)
    weighted = est(R, V, gi, mask, value_source="residual_critic", critic_weight=c, **kw)
    scaled = est(R, c * V, gi, mask, value_source="residual_critic", **kw)
    torch.testing.assert_close(weighted.advantages, scaled.advantages, rtol=1e-9, atol=1e-12)
    assert weighted.metrics["segment/critic_weight"] == c
    if c == 0.0:  # (with lambda 1, as an untrained residual critic)
        zero = est(R, V, gi, mask, value_source="residual_critic", critic_weight=c, **{**kw, "gae_lambda": 1.0})
        grpo = get_adv_estimator("grpo")(AdvantageInputs(R, mask, gi), eps=EPS, norm_adv_by_std=True, global_std=False)
        torch.testing.assert_close(zero.advantages, grpo.advantages, rtol=1e-9, atol=1e-12)
    plain = est(R, V, gi, mask, critic_weight=c, **kw)
    torch.testing.assert_close(plain.advantages, est(R, V, gi, mask, **kw).advantages, rtol=0, atol=0)


def test_the_controller_weights_the_critic_by_its_explained_variance():
    """critic_weight = clip(EV of the epoch before, 0, 1): 0 before any EV, EV 0.75 -> 0.75, a negative EV -> 0; not
    given to the estimator without weight_by_ev; kept through a checkpoint (it is the saved last EV)."""
    c = GroupThresholdController(tau=1.0, weight_by_ev=True)
    assert c.params() == {"tau": 1.0, "critic_weight": 0.0}
    y = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=D)
    c.update(y, y + torch.tensor([0.5, -0.5, 0.5, -0.5], dtype=D))  # EV = 1 - 0.25 / 1.25 = 0.8
    assert c.params()["critic_weight"] == pytest.approx(0.8) and c.metrics()["segment/next_critic_weight"] == pytest.approx(0.8)
    restored = GroupThresholdController(tau=1.0, weight_by_ev=True)
    restored.load_state_dict(c.state_dict())
    assert restored.params() == c.params()
    c.update(y, -y)  # EV = 1 - 5 / 1.25 < 0
    assert c.params()["critic_weight"] == 0.0
    assert set(GroupThresholdController(tau=1.0).params()) == {"tau"}


@settings(max_examples=30, deadline=None)
@given(problem(), st.sampled_from([0.0, 0.3, 1.0]))
def test_tweedie_and_blend_values(prob, w):
    R, V, gi, tau, max_size, lam, mask = prob
    b = torch.stack([R[gi == g].mean() for g in gi])[:, None]
    Q = torch.rand(V.shape, dtype=D, generator=torch.Generator().manual_seed(len(R)))
    kw = dict(tau=tau, max_segment_steps=max_size, gae_lambda=lam, norm_adv_by_std=True)

    def run(values, tweedie=None, **extra):
        inputs = AdvantageInputs(R, mask, gi, values=values, tweedie_values=tweedie)
        return get_adv_estimator("group_ppo")(inputs, **estimator_params("group_ppo", **kw, **extra))

    tweedie = run(V, Q, value_source="tweedie")  # the critic's output is not read
    torch.testing.assert_close(tweedie.advantages, run(Q).advantages, rtol=1e-9, atol=1e-12)
    blend = run(V, Q, value_source="blend", value_blend=w)
    by_hand = run(w * Q + (1 - w) * (b + V))  # V = w Q + (1 - w)(b_g + f)
    torch.testing.assert_close(blend.advantages, by_hand.advantages, rtol=1e-9, atol=1e-12)
    on = blend.endpoint_mask > 0  # the critic still learns the deviation from b_g
    torch.testing.assert_close(blend.critic_targets[on], (by_hand.critic_targets - b)[on], rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="value_source='tweedie' needs inputs.tweedie_values"):
        run(V, value_source="tweedie")


def test_value_source_is_checked_by_name():
    from config.base import get_config
    from ddpo_group.run.config_checks import validate_config
    from ddpo_group.errors import ConfigError

    config = get_config("group_ppo")
    config.group_ppo.value_source = "oracle"
    with pytest.raises(ConfigError, match=r"group_ppo.value_source='oracle'; allowed: \['critic', 'residual_critic', 'tweedie', 'blend', 'tree'\]"):
        validate_config(config)


@settings(max_examples=40, deadline=None)
@given(problem())
def test_lambda_limits(prob):
    R, V, gi, tau, max_size, _, _ = prob
    b = torch.stack([R[gi == g].mean() for g in gi])
    u = post_step_values(V, R)
    # gae_lambda = 0: the group advantages (one per group, read at the endpoints) telescope to R - b_g
    r0 = group_ppo_from_values(V, R, gi, tau=tau, max_segment_steps=max_size, gae_lambda=0.0, numerical_floor=1e-6,
                              norm_adv_by_std=False)
    per_traj = (r0.advantages * r0.step_endpoints).sum(dim=1)
    torch.testing.assert_close(per_traj, R - b, rtol=1e-9, atol=1e-12)
    # gae_lambda = 1: A = R - u_start, u_start = u at the endpoint before the group (b_g for the first group)
    r1 = group_ppo_from_values(V, R, gi, tau=tau, max_segment_steps=max_size, gae_lambda=1.0, numerical_floor=1e-6,
                              norm_adv_by_std=False)
    u_ext = torch.cat([b[:, None], u], dim=1)  # u_ext[:, e + 1] = u_e
    ends = r1.step_endpoints.long()
    start_idx = torch.cumsum(torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], 1), 1)  # group id
    prev_end = torch.full_like(ends, -1)
    for n in range(1, ends.shape[1]):  # index of the last endpoint before step n (test-side loop is fine)
        prev_end[:, n] = torch.where(ends[:, n - 1] == 1, torch.full_like(prev_end[:, n], n - 1), prev_end[:, n - 1])
    expected = R[:, None] - u_ext.gather(1, prev_end + 1)
    torch.testing.assert_close(r1.advantages, expected, rtol=1e-9, atol=1e-12)
    assert torch.equal(start_idx, r1.segment_id)
    # lam_c = 1: every critic target is R
    assert torch.allclose(r1.critic_targets[r1.endpoint_mask > 0], R[:, None].expand_as(u)[r1.endpoint_mask > 0])


def test_step_rewards_enter_delta():
    sr = torch.tensor([[0.0, -0.1, -0.2], [-0.3, 0.0, 0.0]], dtype=D)
    out = get_adv_estimator("group_ppo")(
        AdvantageInputs(R1, torch.ones(2, 3, dtype=D), GI1, values=V1, step_rewards=sr),
        **estimator_params("group_ppo", tau=math.inf, gae_lambda=1.0))
    # one group, lam = 1: A = R + sum of all step rewards - b_g
    torch.testing.assert_close(out.advantages[:, 0], R1 + sr.sum(1) - 0.5)


def test_constant_rewards_and_constant_values_are_finite():
    R = torch.ones(4, dtype=D)
    V = torch.ones(4, 5, dtype=D)
    gi = torch.tensor([0, 0, 1, 1])
    for tau in (0.0, 1.0, math.inf):
        out = est(R, V, gi, tau=tau, norm_adv_by_std=True)
        assert torch.isfinite(out.advantages).all() and out.advantages.abs().max() == 0


def test_std_scaling_gives_a_zero_variance_group_zero_advantage():
    """With norm_adv_by_std a group whose rewards are all equal gets 0, as in grpo, not its critic deltas / eps."""
    R = torch.tensor([0.5, 0.5, 0.5, 0.0, 1.0, 2.0], dtype=D)
    V = torch.rand(6, 4, dtype=D, generator=torch.Generator().manual_seed(0))
    gi = torch.tensor([0, 0, 0, 1, 1, 1])
    plain = est(R, V, gi, tau=0.0)  # every step its own group: A_n = R - u_{n-1} (lam = 1)
    scaled = est(R, V, gi, tau=0.0, norm_adv_by_std=True)
    assert plain.advantages[:3].abs().max() > 0.01  # the critic's values give the constant group nonzero deltas
    assert scaled.advantages[:3].abs().max() == 0
    torch.testing.assert_close(scaled.advantages[3:], plain.advantages[3:] / (1.0 + EPS))  # std_g of [0, 1, 2] is 1


def test_find_group_endpoints_api_and_errors():
    R = R1
    u = post_step_values(V1, R)
    delta = td_deltas(u, torch.full((2,), 0.5, dtype=D))
    ep = find_segment_endpoints(u, delta, 3.0, 16, EPS, group_index=GI1)
    assert ep.is_endpoint.tolist() == [[False, True, True]] * 2 and ep.num_segments.tolist() == [2, 2]
    assert ep.segment_id.tolist() == [[0, 0, 1]] * 2
    # without group_index every row is its own group: sample 0 alone has the same rho here
    ep1 = find_segment_endpoints(None, delta, 3.0, 16, EPS)
    assert ep1.is_endpoint.tolist() == ep.is_endpoint.tolist()
    for bad in (dict(tau=-1.0), dict(max_segment_steps=0), dict(numerical_floor=0.0)):
        kw = dict(tau=1.0, max_segment_steps=4, numerical_floor=EPS) | bad
        with pytest.raises(ValueError):
            find_segment_endpoints(u, delta, **kw)
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator("group_ppo")(AdvantageInputs(R, torch.ones(2, 3), GI1), **estimator_params("group_ppo"))


def test_group_metrics_hand():
    ends = torch.tensor([[False, True, False, True]])
    m = segment_metrics(ends, tau=1.0, rho_at_cut=torch.tensor([2.0, 4.0]))
    assert m["segment/num_endpoints"] == 2 and m["segment/mean_len"] == 2.0 and m["segment/compression_ratio"] == 0.5
    assert m["segment/rho_at_cut"] == 3.0 and m["segment/tau"] == 1.0
    m = segment_metrics(ends, step_mask=torch.tensor([[1, 0, 0, 1]]))
    assert m["segment/compression_ratio"] == 0.0  # each trained step has its own group
    assert math.isnan(segment_metrics(ends, rho_at_cut=torch.zeros(0))["segment/rho_at_cut"])


# ------------------------------------------------------------------------------ controller
def test_controller_direction_and_bounds():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(200, dtype=D, generator=g)
    good = y + 0.1 * torch.randn(200, dtype=D, generator=g)   # EV ~ 0.99 > 0.5
    bad = torch.randn(200, dtype=D, generator=g)              # EV ~ -1 < 0.5
    c = GroupThresholdController(tau=1.0, lr=0.1, min_tau=0.5, max_tau=2.0, target_ev=0.5)
    t1 = c.update(y, bad)
    assert t1 > 1.0 and math.isclose(t1, math.exp(0.1))      # poor critic: s = 1 -> longer groups
    assert c.last_ev < 0
    c2 = GroupThresholdController(tau=1.0, lr=0.1, min_tau=0.5, max_tau=2.0, target_ev=0.5)
    ev = GroupThresholdController.explained_variance(y, good)
    t2 = c2.update(y, good)
    assert t2 < 1.0 and math.isclose(t2, math.exp(0.1 * (0.5 - ev) / 0.5))  # good critic: shorter groups
    for _ in range(50):
        c.update(y, bad)
        c2.update(y, good)
    assert c.tau == 2.0 and c2.tau == 0.5                     # stays inside [min, max]
    # a perfect critic (EV = 1) moves tau by exp(-lr); undefined EV leaves tau alone
    c3 = GroupThresholdController(tau=1.0, lr=0.1)
    assert math.isclose(c3.update(y, y), math.exp(-0.1))
    assert c3.update(torch.ones(5, dtype=D), torch.zeros(5, dtype=D)) == c3.tau
    assert math.isnan(c3.last_ev)
    # masked targets ([B, T] with the endpoint mask)
    mask = torch.zeros(200, dtype=D)
    mask[:100] = 1
    ev_m = GroupThresholdController.explained_variance(y, bad, mask)
    assert math.isclose(ev_m, GroupThresholdController.explained_variance(y[:100], bad[:100]))


def test_controller_fixed_and_state():
    c = GroupThresholdController(tau=1.5, adaptive=False)
    y = torch.randn(50, dtype=D, generator=torch.Generator().manual_seed(1))
    assert c.update(y, torch.zeros_like(y)) == 1.5 and math.isfinite(c.last_ev)
    a = GroupThresholdController(tau=1.0, lr=0.05)
    a.update(y, torch.zeros_like(y))
    b = GroupThresholdController(tau=7.0, lr=0.05)
    b.load_state_dict(a.state_dict())
    assert b.tau == a.tau and b.last_ev == a.last_ev
    assert b.metrics()["segment/next_tau"] == a.tau
    with pytest.raises(ValueError, match="target_ev"):
        GroupThresholdController(target_ev=0.0)
    # tau outside [min, max] is an error with adaptation on (no silent clamp), any tau >= 0 with it off
    with pytest.raises(ValueError, match="outside"):
        GroupThresholdController(tau=100.0, max_tau=10.0)
    assert GroupThresholdController(tau=100.0, max_tau=10.0, adaptive=False).tau == 100.0
    assert GroupThresholdController(tau=0.0, adaptive=False).tau == 0.0
