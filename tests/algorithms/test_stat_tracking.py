"""PerPromptStatTracker (buffer / group modes, stats, checkpoints) and the zero-variance filter."""

import json
import math

import numpy as np
import pytest
import torch

from ddpo_group.algorithms import zero_variance_group_filter
from ddpo_group.algorithms.stat_tracker import PerPromptStatTracker

EPS = 1e-6


def test_buffer_rollover():
    t = PerPromptStatTracker(buffer_size=3, min_count=2)
    adv = t.update(["a", "a"], [1.0, 2.0])  # buffer [1, 2]: mean 1.5, std 0.5
    np.testing.assert_allclose(adv, [-0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)], rtol=1e-12)
    adv = t.update(["a", "a"], [3.0, 4.0])  # FIFO of 3 -> [2, 3, 4]: mean 3, std sqrt(2/3)
    s = math.sqrt(2 / 3)
    np.testing.assert_allclose(adv, [0.0, 1 / (s + EPS)], atol=1e-12)
    assert list(t.stats["a"]) == [2.0, 3.0, 4.0]
    st = t.get_stats()["groups"]["a"]
    assert st["count"] == 3 and st["min"] == 2.0 and st["max"] == 4.0 and math.isclose(st["std"], s)


def test_min_count_falls_back_to_batch_stats():
    t = PerPromptStatTracker(buffer_size=16, min_count=3)
    adv = t.update(["a", "a", "b"], [0.0, 2.0, 4.0])  # all buffers < 3: batch mean 2, std sqrt(8/3)
    s = math.sqrt(8 / 3)
    np.testing.assert_allclose(adv, [-2 / (s + EPS), 0.0, 2 / (s + EPS)], atol=1e-12)
    adv = t.update(["a", "b"], [5.0, 4.0])  # a: [0, 2, 5] >= 3 -> own stats; b: [4, 4] < 3 -> batch
    a = np.array([0.0, 2.0, 5.0])
    np.testing.assert_allclose(adv[0], (5 - a.mean()) / (a.std() + EPS), rtol=1e-12)
    np.testing.assert_allclose(adv[1], (4.0 - 4.5) / (0.5 + EPS), rtol=1e-12)


def test_group_mode_clears_every_update():
    t = PerPromptStatTracker(16, 16, mode="group")
    adv = t.update(["a", "a", "b", "b"], [1.0, 3.0, 5.0, 5.0])
    np.testing.assert_allclose(adv, [-1 / (1 + EPS), 1 / (1 + EPS), 0.0, 0.0], atol=1e-12)
    st = t.get_stats()
    assert st["num_groups"] == 2 and st["zero_std_ratio"] == 0.5
    assert st["groups"]["b"]["zero_std"] and not st["groups"]["a"]["zero_std"]
    assert math.isclose(st["mean_group_std"], 0.5)
    t.update(["c", "c"], [0.0, 1.0])
    assert set(t.get_stats()["groups"]) == {"c"}
    t.clear()
    assert t.get_stats()["num_groups"] == 0


def test_use_std_false_and_dtypes():
    t = PerPromptStatTracker(16, 16, mode="group", use_std=False)
    adv = t.update(["x", "x"], torch.tensor([1.0, 2.0], dtype=torch.float32))
    assert adv.dtype == np.float64
    np.testing.assert_allclose(adv, [-0.5, 0.5])
    with pytest.raises(ValueError):
        t.update(["x"], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-finite"):
        t.update(["x", "x"], [1.0, float("nan")])
    with pytest.raises(ValueError, match="mode"):
        PerPromptStatTracker(16, 16, mode="epoch")


def test_state_round_trip():
    t = PerPromptStatTracker(buffer_size=4, min_count=2)
    rng = np.random.default_rng(0)
    prompts = ["a red circle", "a blue square", "a red circle", "a blue square"]
    t.update(prompts, rng.normal(size=4))
    t.update(prompts, rng.normal(size=4))
    state = json.loads(json.dumps(t.state_dict()))  # plain data
    t2 = PerPromptStatTracker(buffer_size=4, min_count=2)
    t2.load_state_dict(state)
    assert t2.get_stats() == t.get_stats()
    new = rng.normal(size=4)
    np.testing.assert_array_equal(t.update(prompts, new), t2.update(prompts, new))
    with pytest.raises(ValueError, match="mode"):
        PerPromptStatTracker(16, 16, mode="group").load_state_dict(state)


def test_get_metrics_flat_floats():
    t = PerPromptStatTracker(16, 16, mode="group")
    t.update(["a", "a", "b", "b"], [0.0, 1.0, 2.0, 2.0])
    m = t.get_metrics()
    assert m["stat_tracker/zero_std_ratio"] == 0.5 and m["stat_tracker/num_groups"] == 2.0
    assert all(isinstance(v, float) for v in m.values())


def test_zero_variance_filter():
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0, 3.0])
    gi = torch.tensor([5, 5, 9, 9, 2, 2, 2])
    keep, ratio = zero_variance_group_filter(rewards, gi)
    assert keep.tolist() == [False, False, True, True, False, False, False]
    assert math.isclose(ratio, 2 / 3)
    keep, ratio = zero_variance_group_filter(torch.tensor([0.0, 1e-9]), torch.tensor([0, 0]), eps=1e-6)
    assert keep.tolist() == [False, False] and ratio == 1.0
