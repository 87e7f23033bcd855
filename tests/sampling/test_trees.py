"""Tree rollouts (sampling/trajectories.py with ``branches``): shared prefixes, own noise after a branch, the
log-probs a re-score gives, flat sampling as the one-branch limit, the denoiser rows a tree saves."""

import pytest
import torch

from ddpo_group.models import load_family
from ddpo_group.run.reporting.throughput import DenoiserEvaluations
from ddpo_group.sampling.trajectories import SamplingOptions, TransitionScorer, sample_trajectories
from helpers.batch_helpers import batch_of
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config

PROMPTS = ["a red circle", "a cat"]  # two roots
KINDS = [("sd", {}), ("sd3", {"sample.sde_type": "flow_sde"}), ("sd3", {"sample.sde_type": "cps"}),
         ("sd3", {"sample.sde_type": "dance_sde"}), ("flux", {"sample.sde_type": "flow_sde"})]


def family_of(name, model_dir, **overrides):
    config = tiny_config("grpo", model_dir, "unused", **{**FAMILY_OVERRIDES[name], "sample.num_steps": 4,
                                                          "sample.sde_window_size": 3, **overrides})
    return load_family(model_dir, config=config), config


def generators(n):
    return [torch.Generator().manual_seed(1000 + i) for i in range(n)]


def sample_tree(family, config, leaves_per_root, branches, initial_noise=None):
    prompts = [p for p in PROMPTS for _ in range(leaves_per_root)]  # each root's leaves consecutive
    guidance = config.sample.guidance_scale
    negative = family.negative_condition() if guidance > family.no_guidance else None
    cond = family.encode(prompts)
    traj = sample_trajectories(family, family.model, cond, negative,
                               SamplingOptions(4, guidance, family.noise_levels(config.sample), branches=branches),
                               generator=generators(len(prompts)), initial_noise=initial_noise)
    return traj, cond


@pytest.mark.parametrize("name, overrides", KINDS, ids=[n + "".join(f"-{v}" for v in o.values()) for n, o in KINDS])
def test_siblings_share_their_prefix_and_draw_their_own_noise_after_each_branch(name, overrides, family_model_dirs):
    """An SDE window of steps 0-2, branches at steps 1 (2 children) and 2 (2 children): 4 leaves a root. x_0..x_1 shared by a root's leaves
    (bitwise), x_2 by each child's two leaves and different between the children, x_3 different between all;
    every recorded log-prob equals a re-score of its transition; shared_from names the first leaf sharing each x_n."""
    family, config = family_of(name, family_model_dirs[name], **overrides)
    traj, cond = sample_tree(family, config, 4, {1: 2, 2: 2})
    x = traj.latents
    for root in (0, 4):
        leaves = x[root : root + 4]
        assert all(torch.equal(leaves[0, :2], leaf[:2]) for leaf in leaves)
        assert torch.equal(leaves[0, 2], leaves[1, 2]) and torch.equal(leaves[2, 2], leaves[3, 2])
        assert not torch.equal(leaves[0, 2], leaves[2, 2])
        assert len({tuple(leaf[3].flatten()[:8].tolist()) for leaf in leaves}) == 4
    want = torch.tensor([[r, r, r + 2 * (k // 2), r + k, r + k] for r in (0, 4) for k in range(4)])  # x_0 .. x_4
    assert torch.equal(traj.shared_from, want)
    # every (leaf, step) transition scored again as training scores it: the recorded log-prob
    batch = batch_of(traj, cond)
    scorer = TransitionScorer(family, config.sample.guidance_scale, family.noise_level(config.sample))
    scorer.prepare(4, torch.device("cpu"))
    rows, steps = torch.arange(8).repeat_interleave(3), torch.arange(3).repeat(8)  # the SDE window's steps
    with torch.no_grad():
        out = scorer(family.model, batch, rows, steps)
    torch.testing.assert_close(out.log_prob.view(8, 3), traj.log_probs[:, :3], rtol=0, atol=2e-4)


def test_one_branch_at_the_first_step_is_flat_sampling_from_a_shared_initial_noise(family_model_dirs):
    """G = 4 children of a root branching at step 0 = four samples from the root's x_0, each with its own generator:
    the same trajectories as flat sampling from the same initial noise, the step-0 output computed once, not 4 times."""
    family, config = family_of("sd3", family_model_dirs["sd3"], **{"sample.sde_type": "flow_sde"})
    counter = DenoiserEvaluations()
    counter.watch(family.model)
    noise = torch.randn(2, *family.latent_shape(), generator=torch.Generator().manual_seed(7)).repeat_interleave(4, 0)
    with counter.counting("sampling"):
        tree, cond = sample_tree(family, config, 4, {0: 4}, initial_noise=noise)
    tree_rows = counter.take()[0]
    with counter.counting("sampling"):
        flat = sample_trajectories(family, family.model, cond, family.negative_condition(),
                                   SamplingOptions(4, config.sample.guidance_scale, family.noise_levels(config.sample)),
                                   generator=generators(8), initial_noise=noise)
    flat_rows = counter.take()[0]
    torch.testing.assert_close(tree.latents, flat.latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(tree.log_probs, flat.log_probs, rtol=0, atol=1e-5)
    assert flat_rows == 8 * 4 * 2  # CFG: two rows a sample and step
    assert tree_rows == (2 + 8 * 3) * 2  # step 0: the 2 roots; steps 1-3: the 8 leaves


def test_bad_trees_are_refused(family_model_dirs):
    family, config = family_of("sd", family_model_dirs["sd"])
    flat, _ = sample_tree(family, config, 2, {})
    assert flat.shared_from is None
    with pytest.raises(ValueError, match="6 rows are not whole trees of 4 leaves"):
        sample_trajectories(family, family.model, family.encode(["a"] * 6), None,
                            SamplingOptions(4, 1.0, [1.0] * 4, branches={1: 4}), generator=generators(6))
    with pytest.raises(ValueError, match=r"branch step 1: a tree branches at a stochastic step, one of \[0, 2, 3\]"):
        sample_trajectories(family, family.model, family.encode(["a"] * 4), None,
                            SamplingOptions(4, 1.0, [1.0, 0.0, 1.0, 1.0], branches={1: 4}), generator=generators(4))
    with pytest.raises(ValueError, match="one generator per row"):
        sample_trajectories(family, family.model, family.encode(["a"] * 4), None,
                            SamplingOptions(4, 1.0, [1.0] * 4, branches={1: 4}), generator=torch.Generator())
