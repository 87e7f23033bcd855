"""The tree of a prompt group's rollouts (sample.branch_steps / branch_factors; docs/algorithms.md, "Tree rollouts").

With no branch configured and an estimator that reads the tree (group_ppo with value_source="tree", tree_grpo),
the default tree has L = gcd(train.group_size, sample.batch_size) leaves a root (a root as large as a group and a
sampling batch allow: G / L roots a prompt): K = the most branches with 2 children each that L allows (L divisible by
2^(K-1)), at most one per stochastic step, spread evenly over the stochastic steps from the first; the last branch
takes the rest, L / 2^(K-1) children. E.g. the default window (steps 0 and 1) and G = 8, batch 16: 2 children at
step 0 and 4 at step 1; every step of 10 stochastic: 2, 2, 2 at steps 0, 3, 6.
"""

from __future__ import annotations

import math

from ddpo_group.sampling.window import stochastic_steps


def tree_branches(config, reads_tree: bool = False, stochastic: list[int] | None = None) -> dict[int, int]:
    """{step: children} of ``config``: the configured branches, else the default tree when the estimator reads the
    tree (``reads_tree``: module docstring) over the ``stochastic`` steps (default: the SDE window's; the family's
    own leave out its deterministic ones, e.g. CPS's last step), else {} (flat sampling)."""
    configured = dict(zip(map(int, config.sample.branch_steps), map(int, config.sample.branch_factors)))
    if configured or not reads_tree:
        return configured
    if stochastic is None:
        stochastic = stochastic_steps(config.sample).nonzero().flatten().tolist()
    return default_tree(stochastic, math.gcd(int(config.train.group_size), int(config.sample.batch_size)))


def default_tree(stochastic: list[int], leaves: int) -> dict[int, int]:
    """The default tree (module docstring) of ``leaves`` leaves a root over the ``stochastic`` steps."""
    if leaves < 2 or not stochastic:
        return {}
    branches = min(len(stochastic), leaves.bit_length() - 1)  # 2^K <= L
    while branches > 1 and leaves % 2 ** (branches - 1):
        branches -= 1
    steps = [stochastic[k * len(stochastic) // branches] for k in range(branches)]
    return {step: 2 for step in steps[:-1]} | {steps[-1]: leaves // 2 ** (branches - 1)}
