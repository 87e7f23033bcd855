"""The tree of a prompt group's rollouts (sample.branch_steps / branch_factors; docs/algorithms.md, "Tree rollouts").

With no branch configured and an estimator that reads the tree (group_ppo with value_source="tree", tree_grpo),
the default tree: K = the most branches with 2 children each that the group size allows (G divisible by 2^(K-1)), at most one a
stochastic step, spread evenly over the SDE window from its first step; the last branch takes the rest of the group,
G / 2^(K-1) children, so one root is the whole group. E.g. the default window (steps 0 and 1) and G = 8 branch 2 at
step 0 and 4 at step 1; every step of 10 stochastic and G = 8: 2, 2, 2 at steps 0, 3, 6.
"""

from __future__ import annotations

from ddpo_group.sampling.window import stochastic_steps


def tree_branches(config, reads_tree: bool = False) -> dict[int, int]:
    """{step: children} of ``config``: the configured branches, else the default tree when the estimator reads the
    tree (``reads_tree``: module docstring), else {} (flat sampling)."""
    configured = dict(zip(map(int, config.sample.branch_steps), map(int, config.sample.branch_factors)))
    if configured or not reads_tree:
        return configured
    return default_tree(stochastic_steps(config.sample).nonzero().flatten().tolist(), int(config.train.group_size))


def default_tree(stochastic: list[int], group_size: int) -> dict[int, int]:
    """The default tree (module docstring) over the ``stochastic`` steps for a group of ``group_size``."""
    if group_size < 2 or not stochastic:
        return {}
    branches = min(len(stochastic), group_size.bit_length() - 1)  # 2^K <= G
    while branches > 1 and group_size % 2 ** (branches - 1):
        branches -= 1
    steps = [stochastic[k * len(stochastic) // branches] for k in range(branches)]
    return {step: 2 for step in steps[:-1]} | {steps[-1]: group_size // 2 ** (branches - 1)}
