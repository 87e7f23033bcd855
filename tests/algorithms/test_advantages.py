"""Advantage estimators: hand-computed cases, loop references, properties, registry."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ddpo_group.algorithms import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageInputs,
    Registry,
    get_adv_estimator,
    register_adv_est,
)
from ddpo_group.algorithms.stat_tracker import PerPromptStatTracker

D = torch.float64
EPS = 1e-6
# 2 prompts x 3 samples x 4 steps
R = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 3.0], dtype=D)
GI = torch.tensor([0, 0, 0, 1, 1, 1])
MASK = torch.tensor(
    [[1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 1]], dtype=D
)
from helpers.estimator_params import params as estimator_params
T = 4


def run(name, **kw):
    inp = dict(rewards=R, step_mask=MASK, group_index=GI)
    fields = set(AdvantageInputs.__dataclass_fields__)
    params = {k: v for k, v in kw.items() if k not in fields}
    inp.update({k: v for k, v in kw.items() if k in fields})
    return get_adv_estimator(name)(AdvantageInputs(**inp), **estimator_params(name, **params))


def expect_broadcast(out, per_sample):
    exp = torch.tensor(per_sample, dtype=D)[:, None] * MASK
    torch.testing.assert_close(out.advantages, exp, rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- hand-computed
def test_grpo_hand():
    # group 0: mean 2, unbiased std 1; group 1: mean 1, unbiased std sqrt(3)
    s3 = math.sqrt(3.0)
    expect_broadcast(run("grpo"), [-1 / (1 + EPS), 0, 1 / (1 + EPS), -1 / (s3 + EPS), -1 / (s3 + EPS), 2 / (s3 + EPS)])
    assert run("grpo").metrics["reward/zero_std_ratio"] == 0.0


def test_grpo_global_std_hand():
    # all rewards: mean 1.5, sum of squared deviations 9.5, unbiased var 1.9
    s = math.sqrt(1.9) + EPS
    expect_broadcast(run("grpo", global_std=True), [-1 / s, 0, 1 / s, -1 / s, -1 / s, 2 / s])


def test_grpo_without_std_is_dr_grpo():
    expect_broadcast(run("dr_grpo"), [-1, 0, 1, -1, -1, 2])
    torch.testing.assert_close(run("grpo", norm_adv_by_std=False).advantages, run("dr_grpo").advantages)


def test_rloo_hand():
    # leave-one-out: sample 0: 1 - (2+3)/2 = -1.5; sample 5: 3 - 0 = 3
    expect_broadcast(run("rloo"), [-1.5, 0, 1.5, -1.5, -1.5, 3.0])


def test_grpo_passk_hand():
    expect_broadcast(run("grpo_passk", norm_adv_by_std=False), [0, 0, 1, 0, 0, 3])
    expect_broadcast(run("grpo_passk"), [0, 0, 1 / (1 + EPS), 0, 0, 3 / (math.sqrt(3) + EPS)])
    # ties at the top: gap 0 everywhere
    out = get_adv_estimator("grpo_passk")(
        AdvantageInputs(torch.tensor([2.0, 2.0, 1.0], dtype=D), torch.ones(3, 2, dtype=D), torch.zeros(3, dtype=torch.long)),
        norm_adv_by_std=True)
    assert torch.all(out.advantages == 0)


def test_ddpo_hand_batch_stats_then_buffer():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=4)
    prompts = ["a", "a", "a", "b", "b", "b"]
    out = run("ddpo", prompts=prompts, stat_tracker=tracker)
    mu, sd = 1.5, math.sqrt(9.5 / 6)  # batch stats (buffers hold 3 < 4)
    expect_broadcast(out, [(r - mu) / (sd + EPS) for r in R.tolist()])
    # second epoch: buffers reach 4 >= min_count -> buffer stats
    R2 = torch.tensor([1.0, 2.0, 5.0, 0.0, 0.0, 3.0], dtype=D)
    out2 = get_adv_estimator("ddpo")(AdvantageInputs(R2, MASK, GI, prompts=prompts, stat_tracker=tracker))
    # buffer a after second update = last 4 of [1,2,3,1,2,5] = [3,1,2,5]
    buf_a = np.array([3.0, 1.0, 2.0, 5.0])
    buf_b = np.array([3.0, 0.0, 0.0, 3.0])
    exp = [(r - buf_a.mean()) / (buf_a.std() + EPS) for r in [1.0, 2.0, 5.0]]
    exp += [(r - buf_b.mean()) / (buf_b.std() + EPS) for r in [0.0, 0.0, 3.0]]
    expect_broadcast(out2, exp)
    with pytest.raises(ValueError, match="stat_tracker"):
        run("ddpo")


def test_reinforce_plus_plus_hand():
    # two samples, T = 2, gamma = 1: G = [[1, 1], [3, 3]]; mean 2, unbiased var 4/3
    out = get_adv_estimator("reinforce_plus_plus")(
        AdvantageInputs(torch.tensor([1.0, 3.0], dtype=D), torch.ones(2, 2, dtype=D)), gamma=1.0)
    a = 1 / math.sqrt(4 / 3 + 1e-8)
    torch.testing.assert_close(out.advantages, torch.tensor([[-a, -a], [a, a]], dtype=D))
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.0], [3.0, 3.0]], dtype=D))
    # gamma = 0.5 and a step reward: r = [[0, -1, 0, 4]] -> G_3 = 4, G_2 = 2, G_1 = -1 + 1 = 0, G_0 = 0
    sr = torch.tensor([[0.0, -1.0, 0.0, 0.0]], dtype=D)
    out = get_adv_estimator("reinforce_plus_plus")(
        AdvantageInputs(torch.tensor([4.0], dtype=D), torch.ones(1, 4, dtype=D), step_rewards=sr), gamma=0.5)
    torch.testing.assert_close(out.returns, torch.tensor([[0.0, 0.0, 2.0, 4.0]], dtype=D))
    G = np.array([0.0, 0.0, 2.0, 4.0])
    torch.testing.assert_close(out.advantages[0], torch.tensor((G - G.mean()) / np.sqrt(G.var(ddof=1) + 1e-8)))


def test_remax_hand():
    sr = torch.full((6, T), -0.1, dtype=D)
    greedy = torch.tensor([1.5, 1.5, 1.5, 2.0, 2.0, 2.0], dtype=D)
    out = run("remax", greedy_rewards=greedy, step_rewards=sr)
    togo = torch.tensor([-0.4, -0.3, -0.2, -0.1], dtype=D)
    exp = (R[:, None] + togo[None, :] - greedy[:, None]) * MASK
    torch.testing.assert_close(out.advantages, exp)
    with pytest.raises(ValueError, match="greedy_rewards"):
        run("remax")


def test_gae_hand():
    V = torch.tensor([[0.5, 0.8]], dtype=D)
    inp = AdvantageInputs(torch.tensor([1.0], dtype=D), torch.ones(1, 2, dtype=D), values=V)
    out = get_adv_estimator("gae")(inp, gamma=1.0, gae_lambda=0.5, whiten=False, gae_start_value="critic")
    # delta_1 = 1 - 0.8 = 0.2; delta_0 = 0.8 - 0.5 = 0.3; A_0 = 0.3 + 0.5 * 0.2
    torch.testing.assert_close(out.advantages, torch.tensor([[0.4, 0.2]], dtype=D))
    torch.testing.assert_close(out.returns, torch.tensor([[0.9, 1.0]], dtype=D))
    out = get_adv_estimator("gae")(inp, gamma=0.9, gae_lambda=0.5, whiten=False, gae_start_value="critic")
    # delta_0 = 0.9 * 0.8 - 0.5 = 0.22; A_0 = 0.22 + 0.9 * 0.5 * 0.2 = 0.31
    torch.testing.assert_close(out.advantages, torch.tensor([[0.31, 0.2]], dtype=D))
    # whitened over masked entries: mean 0, unbiased var ~1
    V = torch.randn(6, T, dtype=D, generator=torch.Generator().manual_seed(0))
    out = run("gae", values=V, gae_lambda=0.9)
    sel = out.advantages[MASK > 0]
    assert abs(float(sel.mean())) < 1e-9 and abs(float(sel.var()) - 1) < 1e-6
    assert torch.all(out.advantages[MASK == 0] == 0)


def test_gae_group_mean_start_value():
    V = torch.randn(6, T, dtype=D, generator=torch.Generator().manual_seed(1))
    a = run("gae", values=V, gae_lambda=0.7, whiten=False, gae_start_value="group_mean")
    V2 = V.clone()
    V2[:, 0] = torch.tensor([2.0, 2, 2, 1, 1, 1], dtype=D)
    b = run("gae", values=V2, gae_lambda=0.7, whiten=False)
    torch.testing.assert_close(a.advantages, b.advantages)


def test_mask_and_clip_and_dtype():
    out = run("dr_grpo", adv_clip_max=1.5)
    expect_broadcast(out, [-1, 0, 1, -1, -1, 1.5])
    assert "adv/clipfrac" in out.metrics
    out32 = get_adv_estimator("grpo")(AdvantageInputs(R.float(), MASK.bool(), GI), **estimator_params("grpo"))
    assert out32.advantages.dtype == torch.float32 and out32.advantages.shape == (6, T)
    assert all(isinstance(v, float) for v in out32.metrics.values())


def test_unknown_kwargs_are_ignored():
    for name in ("grpo", "dr_grpo", "rloo", "grpo_passk", "reinforce_plus_plus"):
        plain = run(name)
        extra = run(name, totally_unknown_param=3, another=None)
        assert plain.advantages.abs().sum() > 0  # a real output: an all-zero one would compare equal to anything
        torch.testing.assert_close(extra.advantages, plain.advantages, rtol=0, atol=0)
        assert extra.metrics == plain.metrics


def test_group_estimators_reject_singleton_groups_and_step_rewards():
    gi = torch.tensor([0, 0, 0, 1, 1, 2])
    for name in ("grpo", "dr_grpo", "rloo", "grpo_passk"):
        with pytest.raises(ValueError, match="at least 2 samples"):
            get_adv_estimator(name)(AdvantageInputs(R, MASK, gi), **estimator_params(name))
        with pytest.raises(ValueError, match="step_rewards"):
            get_adv_estimator(name)(AdvantageInputs(R, MASK, GI, step_rewards=torch.zeros(6, T, dtype=D)),
                                    **estimator_params(name))
    # what each estimator declares: the start-of-run checks and the trainer read these, never the name
    assert [n for n in ADV_ESTIMATOR_REGISTRY if get_adv_estimator(n).needs_groups] == [
        "dr_grpo", "group_ppo", "grpo", "grpo_passk", "rloo", "tree_grpo"]
    assert [n for n in ADV_ESTIMATOR_REGISTRY if get_adv_estimator(n).needs_critic] == ["gae", "group_ppo"]
    assert [n for n in ADV_ESTIMATOR_REGISTRY if get_adv_estimator(n).accepts_step_rewards] == [
        "gae", "group_ppo", "reinforce_plus_plus", "remax"]


def test_registry_errors():
    with pytest.raises(ValueError) as e:
        get_adv_estimator("nope")
    for name in ("ddpo", "grpo", "dr_grpo", "rloo", "grpo_passk", "reinforce_plus_plus", "remax", "gae", "group_ppo"):
        assert name in str(e.value)
        assert name in ADV_ESTIMATOR_REGISTRY
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo")(lambda inputs, **_: None)
    reg = Registry("thing")
    reg.register("x")(1)
    assert reg.get("x") == 1 and reg.names() == ["x"]
    with pytest.raises(ValueError, match="registered: \\['x'\\]"):
        reg.get("y")


# ------------------------------------------------------------------- loop references (hypothesis)
def loop_reference(name, R, gi, eps=EPS, norm=True):
    R = R.tolist()
    gi = gi.tolist()
    out = [0.0] * len(R)
    for g in set(gi):
        idx = [i for i in range(len(R)) if gi[i] == g]
        r = [R[i] for i in idx]
        G = len(r)
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
        if name == "grpo":
            for i in idx:
                out[i] = (R[i] - mean) / (std + eps)
        elif name == "dr_grpo":
            for i in idx:
                out[i] = R[i] - mean
        elif name == "rloo":
            for i in idx:
                out[i] = R[i] - (sum(r) - R[i]) / (G - 1)
        elif name == "grpo_passk":
            order = sorted(range(G), key=lambda j: -r[j])
            gap = r[order[0]] - r[order[1]]
            out[idx[order[0]]] = gap / (std + eps) if norm else gap
    return torch.tensor(out, dtype=D)


@st.composite
def grouped_batch(draw, min_g=2):
    P = draw(st.integers(1, 4))
    sizes = [draw(st.integers(min_g, 5)) for _ in range(P)]
    ids = draw(st.permutations(list(range(P))))
    gi = torch.tensor([ids[p] * 7 for p, s in enumerate(sizes) for _ in range(s)])  # non-contiguous ids
    perm = torch.tensor(draw(st.permutations(list(range(len(gi))))))
    gi = gi[perm]
    discrete = draw(st.booleans())
    vals = st.sampled_from([0.0, 0.5, 1.0]) if discrete else st.floats(-10, 10, allow_nan=False)
    R = torch.tensor([draw(vals) for _ in range(len(gi))], dtype=D)
    T_ = draw(st.integers(1, 5))
    mask = torch.tensor([[draw(st.booleans()) for _ in range(T_)] for _ in range(len(gi))], dtype=D)
    return R, gi, mask


@settings(max_examples=40, deadline=None)
@given(grouped_batch(), st.sampled_from(["grpo", "dr_grpo", "rloo", "grpo_passk"]))
def test_vectorised_matches_loop(batch, name):
    R_, gi, mask = batch
    out = get_adv_estimator(name)(AdvantageInputs(R_, mask, gi), **estimator_params(name))
    ref = loop_reference(name, R_, gi)
    torch.testing.assert_close(out.advantages, ref[:, None] * mask, rtol=1e-7, atol=1e-7)


@settings(max_examples=30, deadline=None)
@given(grouped_batch())
def test_finite_for_constant_groups(batch):
    R_, gi, mask = batch
    R_ = torch.zeros_like(R_) + 0.1  # every group constant
    V = torch.zeros(mask.shape, dtype=D)
    tracker = PerPromptStatTracker(buffer_size=4, min_count=2)
    prompts = [f"p{int(g)}" for g in gi]
    flat = torch.arange(len(R_))[:, None].expand(-1, mask.shape[1] + 1)  # tree_nodes of flat sampling
    for name in ADV_ESTIMATOR_REGISTRY:
        out = get_adv_estimator(name)(AdvantageInputs(
            R_, mask, gi, prompts=prompts, values=V, greedy_rewards=R_, stat_tracker=tracker, tree_nodes=flat),
            **estimator_params(name))
        assert torch.isfinite(out.advantages).all(), name
        assert torch.isfinite(out.returns).all(), name
        if name in ("grpo", "dr_grpo", "rloo", "grpo_passk", "ddpo", "tree_grpo"):
            assert out.advantages.abs().max() < 1e-6, name


@settings(max_examples=30, deadline=None)
@given(grouped_batch())
def test_grpo_group_mean_zero_std_one(batch):
    R_, gi, mask = batch
    ones = torch.ones_like(mask)
    A = get_adv_estimator("grpo")(AdvantageInputs(R_, ones, gi), **estimator_params("grpo")).advantages[:, 0]
    for g in gi.unique():
        a = A[gi == g]
        r = R_[gi == g]
        assert abs(float(a.mean())) < 1e-9
        if float(r.std()) > 1e-3:
            assert abs(float(a.std()) - 1.0) < 1e-3
