"""Adaptive branching (rollout/branching.py): the credit shares by hand, the branch steps' moves and bounds."""

import pytest
import torch

from ddpo_group.rollout.branching import AdaptiveBranches, credit_shares



def tree(second: int) -> torch.Tensor:
    """tree_nodes [4, 5] of 4 leaves over 4 steps, branches {0: 2, second: 2}: the states x_0 .. x_4."""
    pairs = torch.tensor([0, 0, 2, 2])
    return torch.stack([torch.zeros(4, dtype=torch.long)] + [pairs if n <= second else torch.arange(4)
                                                             for n in range(1, 5)], dim=1)


NODES = tree(2)


def test_the_shares_split_the_reward_variance_into_the_levels_of_the_tree():
    R = torch.tensor([1.0, 3.0, 5.0, 11.0], dtype=torch.float64)
    # root 5; children 2 and 8: level 0 sum (-3)^2 x 2 + 3^2 x 2 = 36; leaves around them: 1 + 1 + 9 + 9 = 20; total 56
    torch.testing.assert_close(credit_shares(NODES, R, [0, 2]), torch.tensor([36 / 56, 20 / 56], dtype=torch.float64))
    assert credit_shares(NODES, torch.full((4,), 2.0, dtype=torch.float64), [0, 2]).tolist() == [0.0, 0.0]


def test_a_branch_moves_toward_the_segment_that_decides_more_within_its_bounds():
    branching = AdaptiveBranches({0: 2, 2: 2}, stochastic=[0, 1, 2, 3])
    metrics = branching.update(NODES, torch.tensor([1.0, 3.0, 5.0, 11.0]))  # shares 0.64 / 0.36: the first decides more
    assert metrics["tree/branch_step_1"] == 2 and metrics["tree/credit_share_0"] == pytest.approx(36 / 56)
    assert branching.branches == {0: 2, 1: 2}  # one step earlier, the children kept
    branching.update(tree(1), torch.tensor([1.0, 3.0, 5.0, 11.0]))
    assert branching.branches == {0: 2, 1: 2}  # not onto the first branch's step
    # the second level decides everything now, but the smoothed shares (0.58 / 0.42) are within the margin
    branching.update(tree(1), torch.tensor([0.0, 10.0, 0.0, 10.0]))
    assert branching.branches == {0: 2, 1: 2}
    again = AdaptiveBranches({0: 2, 2: 2}, stochastic=[0, 1, 2, 3])
    again.load_state_dict(branching.state_dict())
    assert again.branches == branching.branches and torch.equal(again.shares, branching.shares)
    for _ in range(20):  # the second level keeps deciding: the branch moves later, up to the window's last step
        branching.update(tree(max(branching.steps)), torch.tensor([0.0, 10.0, 0.0, 10.0]))
    assert branching.branches == {0: 2, 3: 2}
    with pytest.raises(ValueError, match="moves the branch steps after the first"):
        AdaptiveBranches({1: 4}, stochastic=[0, 1])
