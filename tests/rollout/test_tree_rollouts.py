"""Tree rollouts in the trainer (sample.branch_steps / branch_factors): each prompt group sampled as trees whose leaves
are the batch's samples; shared transitions recorded alike, the denoiser rows a tree saves counted, leaves trained."""

import json

import pytest
import torch

from config.base import get_config
from ddpo_group.errors import ConfigError
from ddpo_group.sampling.tree import default_tree, tree_branches
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

TREE = {"train.group_size": 4, "sample.branch_steps": (1, 2), "sample.branch_factors": (2, 2)}  # 4 leaves a root
# a DDIM and a flow-matching family; every family samples a smaller tree in tests/models/test_family_matrix.py
FAMILIES = ["sd", "sd3"]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_prompt_group_is_sampled_as_a_tree(name, family_model_dirs, tmp_path):
    """8 samples = 2 groups of 4 = 2 roots of 4 leaves, branching at steps 1 and 2 of 4 (every step stochastic).
    Each leaf's transition n equals the one of the leaf tree_nodes[:, n + 1] names (bitwise), a tree is one prompt, the
    children of a branch differ; the denoiser ran 2 + 2 + 4 + 8 node rows (with CFG twice) instead of 8 x 4."""
    trainer = tiny_trainer("grpo", family_model_dirs[name], tmp_path, "tree", **{**FAMILY_OVERRIDES[name], **TREE})
    with trainer.nfe.counting("sampling"):
        batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    family, sample = trainer.family, trainer.config.sample
    cfg_rows = 2 if sample.guidance_scale > family.no_guidance and not family.guidance_embedded else 1
    assert trainer.nfe.take()[0] == (2 + 2 + 4 + 8) * cfg_rows
    nodes = batch.tree_nodes.cpu()
    assert nodes.shape == (8, 5)  # the states x_0 .. x_4
    assert torch.equal(nodes[:, 1], torch.tensor([0, 0, 0, 0, 4, 4, 4, 4]))
    assert torch.equal(nodes[:, 2], torch.tensor([0, 0, 2, 2, 4, 4, 6, 6]))
    assert torch.equal(nodes[:, 4], torch.arange(8))
    for row in range(8):
        assert batch.prompts[row] == batch.prompts[int(nodes[row, 0])]
        for n in range(4):
            first = int(nodes[row, n + 1])  # transition n is shared by the samples sharing x_{n+1}
            for key in ("latents", "next_latents", "log_probs"):
                assert torch.equal(getattr(batch, key)[row, n], getattr(batch, key)[first, n]), (key, row, n)
    assert not torch.equal(batch.next_latents[0, 1], batch.next_latents[2, 1])  # the children of the branch
    assert not torch.equal(batch.next_latents[0, 2], batch.next_latents[1, 2])


def test_an_epoch_trains_every_leaf(tiny_model_dir, tmp_path):
    """The estimator, the loss and the KL see the leaves as flat trajectories: 8 x 4 pairs trained."""
    metrics = tiny_trainer("grpo", tiny_model_dir, tmp_path, "tree_run", **TREE).run()
    assert metrics["perf/nfe_sampling"] == (2 + 2 + 4 + 8) * 2 and metrics["perf/pairs_trained"] == 8 * 4
    assert metrics["global_step"] == 2


def test_group_ppo_measures_its_values_on_the_default_tree(tiny_model_dir, tmp_path):
    """group_ppo.value_source="tree" alone: the default tree of the 4 stochastic steps and a group of 4 (2 children at
    steps 0 and 2); the advantages are GROUP_PPO's on the node values, whose segments start only at branch steps."""
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "tree_values", **{
        "train.group_size": 4, "group_ppo.value_source": "tree"})
    assert trainer.rollouts.branches == {0: 2, 2: 2}
    rollouts = trainer.rollouts.estimate(trainer.rollouts.collect(0))
    endpoints = rollouts.rounds[0].out.extras["step_endpoints"]
    assert not endpoints[:, [0, 2]].any() and endpoints[:, 3].all()  # an endpoint before a branch step, or the last
    advantages = rollouts.batch.advantages
    assert torch.isfinite(advantages).all() and advantages.abs().sum() > 0
    assert rollouts.rounds[0].out.metrics["tree/value_ev"] <= 1  # measured (x_1, x_3 shared by 2 leaves)
    metrics = trainer.run()
    assert metrics["perf/nfe_sampling"] == (2 + 4 + 4 + 8) * 2 and metrics["global_step"] == 2
    assert "tree/value_ev" in metrics


def test_tree_grpo_trains_on_the_default_tree(tiny_model_dir, tmp_path):
    """algorithm.adv_estimator=tree_grpo reads the tree: the default one, and a segment from each branch step."""
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "tree_grpo", **{
        "train.group_size": 4, "algorithm.adv_estimator": "tree_grpo"})
    assert trainer.rollouts.branches == {0: 2, 2: 2}
    metrics = trainer.run()
    assert metrics["tree/segments"] == 2 and metrics["global_step"] == 2 and "tree/value_ev" in metrics


def test_adaptive_branching_logs_the_branch_steps_each_epoch(tiny_model_dir, tmp_path):
    """sample.adaptive_branching on GROUP_PPO's default tree: each epoch logs the branch steps it sampled with and the
    credit shares, which sum to 1; the steps stay ascending inside the window."""
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "adaptive", num_epochs=3, **{
        "train.group_size": 4, "group_ppo.value_source": "tree", "sample.adaptive_branching": True})
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "adaptive" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tree/branch_step_0"] for r in records] == [0, 0, 0]
    assert records[0]["tree/branch_step_1"] == 2 and all(1 <= r["tree/branch_step_1"] <= 3 for r in records)
    for r in records:
        assert r["tree/credit_share_0"] + r["tree/credit_share_1"] == pytest.approx(1.0)


def test_the_default_tree_fits_the_group_the_sampling_batch_and_the_stochastic_steps(tiny_sd3_dir, tmp_path):
    """L = gcd(group size, sampling batch) leaves a root, 2-way branches spread over the stochastic steps, the last
    taking the rest; a branch at a step the family samples without noise (CPS's last) is refused at start."""
    assert default_tree([0, 1], 8) == {0: 2, 1: 4} and default_tree(list(range(10)), 8) == {0: 2, 3: 2, 6: 2}
    assert default_tree([0, 1], 6) == {0: 2, 1: 3} and default_tree([0, 1], 7) == {0: 7} and default_tree([0], 1) == {}
    config = get_config("flow_grpo_sd35")  # G = 24, 8 images a sampling batch: 3 roots of 8 leaves a prompt
    assert tree_branches(config, reads_tree=True, stochastic=[0, 1]) == {0: 2, 1: 4}
    with pytest.raises(ConfigError, match=r"branch steps \[1, 3\].*must be steps sd3 samples with noise: \[0, 1, 2\]"):
        tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "cps", **{
            **FAMILY_OVERRIDES["sd3"], **TREE, "sample.sde_type": "cps", "sample.branch_steps": (1, 3)})
