"""Adaptive branching (sample.adaptive_branching): after each epoch the branch steps of the tree rollouts move toward
where the reward's variance is decided.

On a tree the reward's spread around the root splits exactly into the levels of the branches (the law of total
variance on the sample means): for branch k at step b_k, with V the node values (algorithms/group_ppo.py
tree_values),

    share_k = sum over leaves of (V(x_{b_k + 1}) - V(x_{b_k}))^2  /  sum over leaves of (R - V(x_0))^2

is the share of the variance decided by the steps from b_k to the next branch (the shares sum to 1). A segment that
decides more than its neighbour is split finer: each branch step k >= 1 moves one step toward the side whose share is
the larger, when it is more than MARGIN times the other (shares smoothed over epochs with DECAY). Bounded: the first
branch stays (the steps before it are shared by every leaf of a root and carry no credit the tree can measure), the
others stay ascending inside the SDE window and move at most one step an epoch; the children of each branch keep
their number. Logged as tree/branch_step_k and tree/credit_share_k, checkpointed with the run.
"""

from __future__ import annotations

import torch

from ddpo_group.algorithms.group_ppo import tree_values

DECAY = 0.9  # the shares' exponential moving average over epochs
MARGIN = 1.5  # a branch moves when one neighbouring segment's share is this many times the other's


def credit_shares(tree_nodes: torch.Tensor, rewards: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """[K] share_k of each branch step (module docstring); zeros when every reward is its root's mean."""
    values, _ = tree_values(tree_nodes, rewards)
    R = rewards.detach().double().reshape(-1)
    after = torch.cat([values[:, 1:], R[:, None]], dim=1)  # V(x_{n+1}), V(x_T) = R
    level = torch.stack([(after[:, b] - values[:, b]).pow(2).sum() for b in steps])
    total = (R - values[:, 0]).pow(2).sum()
    return level / total if total > 0 else torch.zeros(len(steps), dtype=R.dtype)


class AdaptiveBranches:
    """The branch steps of the next epoch's trees (module docstring): ``branches`` {step: children} now, ``update``
    after an epoch with its gathered tree_nodes [B, T+1] and rewards [B]; a checkpointed piece of the run."""

    def __init__(self, branches: dict[int, int], stochastic: list[int]):
        if len(branches) < 2:
            raise ValueError(f"adaptive branching moves the branch steps after the first: {branches} has "
                             f"{len(branches)} branch")
        self.steps, self.factors = list(branches), list(branches.values())
        self.last_step = max(stochastic)
        self.shares: torch.Tensor | None = None

    @property
    def branches(self) -> dict[int, int]:
        return dict(zip(self.steps, self.factors))

    def update(self, tree_nodes: torch.Tensor, rewards: torch.Tensor) -> dict:
        """Measure the epoch's shares, move the branch steps; returns the tree/* metrics (the steps just used)."""
        shares = credit_shares(tree_nodes.cpu(), rewards.cpu(), self.steps)
        metrics = {f"tree/branch_step_{k}": step for k, step in enumerate(self.steps)}
        metrics.update({f"tree/credit_share_{k}": float(share) for k, share in enumerate(shares)})
        self.shares = shares if self.shares is None else DECAY * self.shares + (1 - DECAY) * shares
        for k in range(1, len(self.steps)):
            low = self.steps[k - 1] + 1
            high = self.steps[k + 1] - 1 if k + 1 < len(self.steps) else self.last_step
            before, after = float(self.shares[k - 1]), float(self.shares[k])
            if before > MARGIN * after and self.steps[k] > low:  # the segment before decides more: split it finer
                self.steps[k] -= 1
            elif after > MARGIN * before and self.steps[k] < high:
                self.steps[k] += 1
        return metrics

    def state_dict(self) -> dict:
        return {"steps": list(self.steps), "shares": None if self.shares is None else self.shares.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [int(step) for step in state["steps"]]
        self.shares = None if state["shares"] is None else torch.tensor(state["shares"], dtype=torch.float64)
