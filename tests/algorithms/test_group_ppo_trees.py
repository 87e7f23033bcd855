"""Values measured on tree rollouts (group_ppo.tree_values): the node values by hand, GROUP_PPO's exact limits
(value_source="tree") and tree_grpo on a tree small enough to write out."""

import math

import pytest
import torch

from ddpo_group.algorithms import AdvantageInputs, get_adv_estimator
from ddpo_group.algorithms.group_ppo import group_ppo_from_values, tree_value_ev, tree_values
from helpers.estimator_params import params as estimator_params

# one prompt group, one root of 4 leaves, 3 steps: branch 2 at step 0, 2 at step 1 (x_2, x_3: the leaves)
NODES = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1], [0, 2, 2, 2], [0, 2, 3, 3]])
R = torch.tensor([1.0, 3.0, 5.0, 11.0], dtype=torch.float64)
GROUP = torch.zeros(4, dtype=torch.long)


def test_node_values_are_the_mean_returns_of_the_leaves_below():
    values, branch = tree_values(NODES, R)
    assert values.tolist() == [[5, 2, 1], [5, 2, 3], [5, 8, 5], [5, 8, 11]]  # root, children {0,1} / {2,3}, leaves
    assert branch.tolist() == [True, True, False]
    # a step reward r_n counts for the states before it: V(x_n) = mean of R + sum_{m >= n} r_m
    step_rewards = torch.tensor([[0.0, 0.0, 1.0]] * 2 + [[0.0, 2.0, 0.0]] * 2, dtype=torch.float64)
    with_steps, _ = tree_values(NODES, R, step_rewards)
    assert with_steps.tolist() == [[6.5, 3, 2], [6.5, 3, 4], [6.5, 10, 5], [6.5, 10, 11]]


@pytest.mark.parametrize("tau, gae_lambda, want", [
    (math.inf, 1.0, [[-4] * 3, [-2] * 3, [0] * 3, [6] * 3]),  # one segment: R - mean_g, grpo's
    (math.inf, 0.0, [[-4] * 3, [-2] * 3, [0] * 3, [6] * 3]),
    (0.0, 0.0, [[-3, -1, -1], [-3, 1, 1], [3, -3, -3], [3, 3, 3]]),  # cut at the branch: V(child) - V(root), R - V(child)
    (0.0, 1.0, [[-4, -1, -1], [-2, 1, 1], [0, -3, -3], [6, 3, 3]]),  # R - V(node at the segment's start)
])
def test_group_ppo_limits_on_a_tree(tau, gae_lambda, want):
    """tau = inf: one segment, grpo; tau = 0: a segment from each branch step (the only cuts allowed), the last one
    closed at T-1; lambda = 0 the segments' own value differences, lambda = 1 the Monte-Carlo returns."""
    values, branch = tree_values(NODES, R)
    out = group_ppo_from_values(values, R, GROUP, tau=tau, gae_lambda=gae_lambda, cut_steps=branch, max_segment_steps=16,
                               numerical_floor=1e-6, norm_adv_by_std=False)
    assert out.advantages.tolist() == want
    assert out.step_endpoints.tolist() == [[tau == 0.0, False, True]] * 4


def test_tree_grpo_gives_each_branch_its_nodes_difference():
    """tree_grpo: the steps from a branch step to the next get V(next node) - V(node), over the group's std; a tree
    branching once, at step 0, is grpo."""
    inputs = AdvantageInputs(R, torch.ones(4, 3, dtype=torch.float64), GROUP, tree_nodes=NODES)
    out = get_adv_estimator("tree_grpo")(inputs, norm_adv_by_std=True)
    want = torch.tensor([[-3, -1, -1], [-3, 1, 1], [3, -3, -3], [3, 3, 3]], dtype=torch.float64) / (R.std() + 1e-6)
    torch.testing.assert_close(out.advantages, want, rtol=0, atol=1e-12)
    once = torch.tensor([[0, 0, 0, 0], [0, 1, 1, 1], [0, 2, 2, 2], [0, 3, 3, 3]])  # 4 children at step 0
    flat = AdvantageInputs(R, torch.ones(4, 3, dtype=torch.float64), GROUP, tree_nodes=once)
    torch.testing.assert_close(get_adv_estimator("tree_grpo")(flat, norm_adv_by_std=True).advantages,
                               get_adv_estimator("grpo")(flat, **estimator_params("grpo")).advantages, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="tree_grpo needs inputs.tree_nodes"):
        get_adv_estimator("tree_grpo")(AdvantageInputs(R, torch.ones(4, 3, dtype=torch.float64), GROUP),
                                       norm_adv_by_std=True)


def test_the_tree_values_explained_variance_by_hand():
    """4 leaves of one prompt, branching at steps 0 and 1 (x_1 shared in pairs, x_2 each its own): only x_1 counts.
    Leave-one-out: leaf 0's sibling predicts 3, its group (the other three) 17/3; EV = 1 - 40 / (560 / 9) = 5/14."""
    nodes = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 2, 2], [0, 2, 3]])
    group = torch.zeros(4, dtype=torch.long)
    rewards = torch.tensor([1.0, 3.0, 5.0, 9.0])
    assert tree_value_ev(nodes, rewards, group) == pytest.approx(5 / 14, abs=1e-12)
    # step rewards from x_1 on add to each return: +1 for leaves 2, 3 on their own step 1 shifts one pair
    steps = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    returns = rewards + steps.sum(1)
    assert tree_value_ev(nodes, rewards, group, steps) == pytest.approx(tree_value_ev(nodes, returns, group))
    # siblings alike in pairs but unlike each other: one sibling foresees worse than the other three (EV < 0)
    assert tree_value_ev(nodes, torch.tensor([1.0, 3.0, 1.0, 3.0]), group) == pytest.approx(1 - 16 / (64 / 9))
    flat = torch.arange(4)[:, None].expand(4, 3)  # no shared state: nothing to explain
    assert math.isnan(tree_value_ev(flat, rewards, group))
    assert math.isnan(tree_value_ev(nodes, torch.ones(4), group))  # equal returns: no variance


def test_the_per_leaf_policy_gradient_of_a_tree_is_the_flat_one_in_expectation():
    """docs/algorithms.md "What trains": a transition shared by k leaves is trained once per leaf, with each leaf's
    advantage. Enumerated on a 2-step policy of binary actions (pi(a_0 = 1) = sigmoid(t_0), pi(a_1 = 1 | a_0) =
    sigmoid(t_1 + t_2 a_0)), a group of 2 leaves, advantages R - c: the expected gradient of the trainer's PPO loss
    at ratio 1 is the same for 2 independent samples (16 outcomes) and for a tree sharing step 0 (8 outcomes), and it
    is -grad J / 2 (step-mean over 2 leaves x 2 steps)."""
    import itertools

    from ddpo_group.algorithms import aggregation_weights
    from ddpo_group.algorithms.policy_losses import vanilla_policy_loss

    theta = torch.tensor([0.3, -0.5, 0.8], dtype=torch.float64, requires_grad=True)
    reward = torch.tensor([[0.1, 0.7], [0.4, 1.3]], dtype=torch.float64)
    baseline = 0.5

    def log_pi(a0: int, a1: int) -> torch.Tensor:  # [2]: log pi(a_0), log pi(a_1 | a_0)
        p0 = torch.sigmoid(theta[0])
        p1 = torch.sigmoid(theta[1] + theta[2] * a0)
        return torch.stack([torch.log(p0 if a0 else 1 - p0), torch.log(p1 if a1 else 1 - p1)])

    def expected_gradient(outcomes, group_mean: bool = False) -> torch.Tensor:  # [(probability, [(a0, a1)])]
        total = 0.0
        for probability, leaves in outcomes:
            log_prob = torch.stack([log_pi(a0, a1) for a0, a1 in leaves])  # the shared step repeated per leaf
            returns = torch.stack([reward[a0, a1] for a0, a1 in leaves])
            advantages = (returns - (returns.mean() if group_mean else baseline))[:, None].expand(-1, 2)
            weights = aggregation_weights(torch.ones_like(log_prob), "step-mean", dtype=log_prob.dtype)
            loss, _ = vanilla_policy_loss(log_prob.detach(), log_prob, advantages, weights, clip_low=0.2,
                                          clip_high=0.2, clip_ratio_c=3.0)
            total = total + probability * loss
        return torch.autograd.grad(total, theta)[0]

    with torch.no_grad():
        p = {(a0, a1): float(log_pi(a0, a1).sum().exp()) for a0, a1 in itertools.product((0, 1), repeat=2)}
        p_root = {a0: p[(a0, 0)] + p[(a0, 1)] for a0 in (0, 1)}
    flat = [(p[x] * p[y], [x, y]) for x, y in itertools.product(p, repeat=2)]
    tree = [(p_root[a0] * (p[(a0, b)] / p_root[a0]) * (p[(a0, c)] / p_root[a0]), [(a0, b), (a0, c)])
            for a0, b, c in itertools.product((0, 1), repeat=3)]
    assert sum(q for q, _ in flat) == pytest.approx(1) and sum(q for q, _ in tree) == pytest.approx(1)
    J = sum(log_pi(a0, a1).sum().exp() * reward[a0, a1] for a0, a1 in p)
    grad_J = torch.autograd.grad(J, theta)[0]
    torch.testing.assert_close(expected_gradient(flat), -grad_J / 2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(expected_gradient(tree), -grad_J / 2, rtol=1e-12, atol=1e-14)
    # and a single outcome's gradient differs between the two: the estimators differ, their expectations do not
    assert not torch.allclose(expected_gradient([(1.0, [(1, 0), (1, 1)])]), -grad_J / 2)
    # grpo's baseline, the group's mean, is not independent of a leaf: flat it gives (1 - 1/G) of that, -grad J / 4;
    # on the tree the step every leaf shares gets no gradient at all (its component of grad J is lost: t_0's)
    torch.testing.assert_close(expected_gradient(flat, group_mean=True), -grad_J / 4, rtol=1e-12, atol=1e-14)
    tree_grpo = expected_gradient(tree, group_mean=True)
    assert abs(float(tree_grpo[0])) < 1e-14 and abs(float(grad_J[0])) > 0.1
    torch.testing.assert_close(tree_grpo[1:], -grad_J[1:] / 4, rtol=1e-12, atol=1e-14)
