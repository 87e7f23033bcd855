"""The rollout correction (algorithms/rollout_correction.py) against a hand computation: the log-ratio of each step and
of a trajectory, the truncated weights, the rejection band (its lower bound 1 / upper by default), the measures; the
config's refusals."""

import math
import re

import ml_collections
import pytest
import torch

from config.base import get_config
from ddpo_group.algorithms.rollout_correction import rollout_correction
from ddpo_group.run.config_checks import algorithm_errors


def settings(**fields):
    config = ml_collections.ConfigDict({"is_level": "", "is_threshold": 2.0, "rs_level": "", "rs_threshold": 2.0,
                                        "rs_threshold_lower": 0.0})
    config.update(fields)
    return config


# two trajectories of three steps, the last step not trainable (its delta must not count)
ROLLOUT = torch.zeros(2, 3)
DELTA = torch.tensor([[math.log(3.0), math.log(0.8), 5.0], [math.log(1.1), math.log(0.4), -5.0]])
MASK = torch.tensor([[True, True, False], [True, True, False]])


def test_off_every_trained_pair_weighs_one():
    out = rollout_correction(ROLLOUT, ROLLOUT + DELTA, MASK, settings())
    assert torch.equal(out.factor, MASK.float())
    assert out.metrics["rollout_is_weight_mean"] == 1.0 and out.metrics["rollout_rs_masked"] == 0.0
    by_hand = (math.log(3.0) - math.log(0.8) + math.log(1.1) - math.log(0.4)) / 4
    assert out.metrics["rollout_log_ratio_abs"] == pytest.approx(by_hand, rel=1e-6)


def test_step_weights_are_each_steps_ratio_truncated():
    out = rollout_correction(ROLLOUT, ROLLOUT + DELTA, MASK, settings(is_level="step", is_threshold=2.0))
    want = torch.tensor([[2.0, 0.8, 0.0], [1.1, 0.4, 0.0]])  # 3 capped at 2; the untrained step 0
    torch.testing.assert_close(out.factor, want, rtol=1e-6, atol=0)
    assert out.metrics["rollout_is_truncated"] == 0.25
    weights = torch.tensor([2.0, 0.8, 1.1, 0.4])
    assert out.metrics["rollout_is_weight_mean"] == pytest.approx(float(weights.mean()), rel=1e-6)
    assert out.metrics["rollout_is_weight_std"] == pytest.approx(float(weights.std()), rel=1e-6)


def test_trajectory_weights_are_the_product_of_its_trained_steps_ratios():
    out = rollout_correction(ROLLOUT, ROLLOUT + DELTA, MASK, settings(is_level="trajectory", is_threshold=5.0))
    first, second = 3.0 * 0.8, 1.1 * 0.4  # the untrained step's e^5 and e^-5 left out
    torch.testing.assert_close(out.factor, torch.tensor([[first, first, 0.0], [second, second, 0.0]]), rtol=1e-6,
                               atol=0)
    capped = rollout_correction(ROLLOUT, ROLLOUT + DELTA, MASK, settings(is_level="trajectory", is_threshold=2.0))
    assert float(capped.factor[0, 0]) == 2.0 and capped.metrics["rollout_is_truncated"] == 0.5


def test_rejection_drops_the_pairs_or_trajectories_outside_the_band():
    step = rollout_correction(ROLLOUT, ROLLOUT + DELTA, MASK, settings(rs_level="step", rs_threshold=2.0))
    # band [1/2, 2]: 3 above it, 0.4 below it
    assert torch.equal(step.factor, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert step.metrics["rollout_rs_masked"] == 0.5
    lower = rollout_correction(ROLLOUT, ROLLOUT + DELTA, MASK, settings(rs_level="step", rs_threshold=4.0,
                                                                        rs_threshold_lower=0.9))
    assert torch.equal(lower.factor, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))  # 0.8 and 0.4 below 0.9
    trajectory = rollout_correction(ROLLOUT, ROLLOUT + DELTA, MASK, settings(rs_level="trajectory", rs_threshold=2.0))
    # 2.4 above the band: its whole trajectory dropped; 0.44 below 1/2: the other's too
    assert torch.equal(trajectory.factor, torch.zeros(2, 3)) and trajectory.metrics["rollout_rs_masked"] == 1.0
    both = rollout_correction(ROLLOUT, ROLLOUT + DELTA, MASK, settings(is_level="step", rs_level="step"))
    torch.testing.assert_close(both.factor, torch.tensor([[0.0, 0.8, 0.0], [1.1, 0.0, 0.0]]), rtol=1e-6, atol=0)


def test_a_ratio_of_one_is_left_alone_and_an_overflow_bounded():
    same = rollout_correction(ROLLOUT, ROLLOUT, MASK, settings(is_level="step", rs_level="trajectory",
                                                                rs_threshold=1.0001))
    assert torch.equal(same.factor, MASK.float()) and same.metrics["rollout_is_weight_std"] == 0.0
    huge = rollout_correction(ROLLOUT, ROLLOUT + 1e4, MASK, settings(is_level="step", is_threshold=1e30))
    assert float(huge.factor.max()) == pytest.approx(math.exp(20.0), rel=1e-6)


@pytest.mark.parametrize("fields, message", [
    ({"is_level": "token"}, r"is_level='token' must be one of \('', 'step', 'trajectory'\)"),
    ({"rs_level": "step", "rs_threshold": 1.0}, r"rs_threshold=1.0 must be > 1"),
    ({"rs_level": "step", "rs_threshold_lower": 1.5}, r"rs_threshold_lower=1.5 must be in \[0, 1\)"),
    ({"is_level": "step", "is_threshold": 0.0}, r"is_threshold=0.0 must be > 0"),
])
def test_bad_settings_are_refused_by_name(fields, message):
    config = get_config("grpo")
    config.algorithm.rollout_correction.update(fields)
    assert any(re.search(message, error) for error in algorithm_errors(config)), algorithm_errors(config)


def test_step_weights_with_a_trajectory_loss_and_a_matching_objective_are_refused():
    config = get_config("grpo")
    config.algorithm.policy_loss = "gspo"
    config.algorithm.rollout_correction.is_level = "step"
    assert any("is_level='step' weighs each step's loss; algorithm.policy_loss='gspo'" in e
               for e in algorithm_errors(config))
    config.algorithm.rollout_correction.is_level = "trajectory"
    assert not any("rollout_correction" in e for e in algorithm_errors(config))
    nft = get_config("grpo")
    nft.algorithm.objective, nft.sample.deterministic = "nft", True
    nft.algorithm.rollout_correction.rs_level = "step"
    assert any("algorithm.objective='nft' has no such loss" in e for e in algorithm_errors(nft))
