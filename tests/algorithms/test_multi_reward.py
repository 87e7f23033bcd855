"""Multi-reward advantages: each component normalised within its prompt group, then weighted (GDPO / MixGRPO)."""

import math

import torch

from ddpo_group.algorithms import AdvantageInputs, component_metrics, component_normalized_sum, get_adv_estimator
from helpers.estimator_params import params as estimator_params

D = torch.float64
EPS = 1e-6


def estimate(name, rewards, groups, **params):
    inputs = AdvantageInputs(rewards=rewards, step_mask=torch.ones(len(rewards), 3, dtype=D), group_index=groups)
    return get_adv_estimator(name)(inputs, **estimator_params(name, **params)).advantages[:, 0]


def test_per_component_normalisation_against_a_hand_computation():
    # 2 prompt groups (ids 5 and 9, interleaved) of 3 samples; components a (weight 1) and b (weight 2)
    groups = torch.tensor([5, 9, 5, 9, 5, 9])
    a = torch.tensor([1.0, 0.0, 2.0, 0.0, 6.0, 3.0], dtype=D)
    b = torch.tensor([0.5, 10.0, 0.5, 20.0, 0.5, 30.0], dtype=D)
    S, z = component_normalized_sum(torch.stack([a, b], dim=1), [1.0, 2.0], groups)
    # group 5: a = 1, 2, 6: mean 3, Bessel variance (4 + 1 + 9) / 2 = 7; b constant: 0 everywhere
    # group 9: a = 0, 0, 3: mean 1, variance (1 + 1 + 4) / 2 = 3; b = 10, 20, 30: mean 20, variance 200 / 2 = 100
    s7, s3 = math.sqrt(7) + EPS, math.sqrt(3) + EPS
    za = [-2 / s7, -1 / s3, -1 / s7, -1 / s3, 3 / s7, 2 / s3]
    zb = [0.0, -10 / (10 + EPS), 0.0, 0.0, 0.0, 10 / (10 + EPS)]
    torch.testing.assert_close(z, torch.tensor([za, zb], dtype=D).T, rtol=0, atol=1e-15)
    torch.testing.assert_close(S, torch.tensor([x + 2 * y for x, y in zip(za, zb)], dtype=D), rtol=0, atol=1e-15)

    # the logged per-component advantages: stats of z_k (population std) and the share of groups where k is constant
    metrics = component_metrics(torch.stack([a, b], dim=1), z, ["a", "b"], groups)
    assert metrics["adv/a/max"] == max(za) and metrics["adv/b/min"] == min(zb)
    assert metrics["adv/a/std"] == torch.tensor(za, dtype=D).std(unbiased=False).item()
    assert metrics["adv/a/zero_std_ratio"] == 0.0 and metrics["adv/b/zero_std_ratio"] == 0.5
    assert abs(metrics["adv/a/mean"]) < 1e-15


def test_the_estimator_after_the_sum_gives_mixgrpo_and_gdpo():
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    r = torch.tensor([[0.1, 3.0], [0.7, 1.0], [0.2, 2.0], [0.9, 2.0], [0.3, 8.0], [0.3, 1.0], [0.8, 5.0], [0.5, 0.0]],
                     dtype=D)
    weights = [0.25, 0.75]
    S, z = component_normalized_sum(r, weights, groups)
    # MixGRPO (advantage_aggr): the weighted sum of the per-component group z-scores, nothing after
    torch.testing.assert_close(estimate("dr_grpo", S, groups), S, rtol=0, atol=1e-14)
    torch.testing.assert_close(estimate("grpo", S, groups, norm_adv_by_std=False), S, rtol=0, atol=1e-14)
    # GDPO: then the batch-wise normalisation (S - mean_batch) / (std_batch + eps), Bessel-corrected
    gdpo = (S - S.mean()) / (S.std(unbiased=True) + EPS)
    torch.testing.assert_close(estimate("grpo", S, groups, global_std=True), gdpo, rtol=0, atol=1e-14)


def test_one_component_is_todays_path():
    groups = torch.tensor([3, 3, 3, 7, 7, 7, 7])
    r = torch.tensor([0.2, -1.5, 4.0, 2.0, 2.5, 1.0, 0.0], dtype=D)
    S, z = component_normalized_sum(r[:, None], [1.0], groups)
    today = estimate("grpo", r, groups)  # sum (= r) then normalise: (r - mean_g) / (std_g + eps)
    torch.testing.assert_close(z[:, 0], today, rtol=0, atol=1e-15)
    torch.testing.assert_close(estimate("dr_grpo", S, groups), today, rtol=0, atol=1e-14)
    # a weight w scales it
    S3, _ = component_normalized_sum(r[:, None], [3.0], groups)
    torch.testing.assert_close(S3, 3 * today, rtol=0, atol=1e-14)


def test_invariants_group_mean_zero_and_each_components_scale_does_not_matter():
    torch.manual_seed(0)
    groups = torch.arange(6).repeat_interleave(4)[torch.randperm(24)]
    r = torch.randn(24, 3, dtype=D)
    S, z = component_normalized_sum(r, [1.0, 0.5, 2.0], groups)
    for g in range(6):  # every z_k, hence S, has mean 0 in every group: the group estimator's baseline is 0
        assert z[groups == g].mean(0).abs().max() < 1e-15 and abs(S[groups == g].mean()) < 1e-15
    # a component in other units (kB instead of MB, shifted) gives the same advantages (up to eps / std)
    rescaled = r * torch.tensor([1000.0, 1.0, 0.01], dtype=D) + torch.tensor([-7.0, 0.0, 3.0], dtype=D)
    S2, _ = component_normalized_sum(rescaled, [1.0, 0.5, 2.0], groups)
    torch.testing.assert_close(S2, S, rtol=0, atol=1e-3)
    # whereas today's weighted sum is dominated by the large-scale component
    today = estimate("grpo", rescaled @ torch.tensor([1.0, 0.5, 2.0], dtype=D), groups)
    assert torch.corrcoef(torch.stack([today, z[:, 0]]))[0, 1] > 0.99


def test_distinct_reward_combinations_keep_distinct_advantages():
    """GDPO's example: 2 samples per prompt, two 0/1 rewards. Summed then group-normalised, a group (1, 1) vs (0, 0)
    and a group (1, 0) vs (0, 0) both give +-1/sqrt(2); normalised per component, the first gets twice the advantage."""
    groups = torch.tensor([0, 0, 1, 1])
    r = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=D)
    today = estimate("grpo", r.sum(1), groups)
    torch.testing.assert_close(today.abs(), torch.full((4,), 1 / math.sqrt(2), dtype=D), rtol=1e-5, atol=0)
    S, _ = component_normalized_sum(r, [1.0, 1.0], groups)
    gdpo = estimate("grpo", S, groups, global_std=True)
    torch.testing.assert_close(gdpo[0] / gdpo[2], torch.tensor(2.0, dtype=D), rtol=1e-9, atol=0)
    # dividing by the group std again brings the collapse back (why the config checks reject grpo's default)
    again = estimate("grpo", S, groups)
    torch.testing.assert_close(again[0], again[2], rtol=1e-5, atol=0)
