"""Tree rollouts in the trainer (sample.branch_steps / branch_factors): each prompt group sampled as trees whose leaves
are the batch's samples; shared transitions recorded alike, the denoiser rows a tree saves counted, leaves trained."""

import torch

from trainer_helpers import tiny_trainer

TREE = {"train.group_size": 4, "sample.branch_steps": (1, 2), "sample.branch_factors": (2, 2)}  # 4 leaves a root


def test_an_epoch_samples_each_prompt_group_as_a_tree_and_trains_its_leaves(tiny_model_dir, tmp_path):
    """8 samples = 2 groups of 4 = 2 roots of 4 leaves, branching at steps 1 and 2 of 4 (every step stochastic).
    Each leaf's transition n equals the one of the leaf tree_nodes[:, n] names (bitwise), a tree is one prompt;
    the denoiser ran 2 + 2 + 4 + 8 node rows (CFG: twice) instead of 8 x 4; every leaf's 4 steps are trained."""
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "tree", **TREE)
    batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    nodes = batch["tree_nodes"]
    assert nodes.shape == (8, 4)
    assert torch.equal(nodes[:, 0], torch.tensor([0, 0, 0, 0, 4, 4, 4, 4]))
    assert torch.equal(nodes[:, 1], torch.tensor([0, 0, 2, 2, 4, 4, 6, 6]))
    assert torch.equal(nodes[:, 3], torch.arange(8))
    for row in range(8):
        assert batch["prompts"][row] == batch["prompts"][int(nodes[row, 0])]
        for n in range(4):
            first = int(nodes[row, n])
            assert torch.equal(batch["latents"][row, n], batch["latents"][first, n])
            assert torch.equal(batch["next_latents"][row, n], batch["next_latents"][first, n])
            assert torch.equal(batch["log_probs"][row, n], batch["log_probs"][first, n])
    assert not torch.equal(batch["next_latents"][0, 1], batch["next_latents"][2, 1])  # the children of the branch
    assert len(set(batch["rewards"].tolist())) > 2  # leaves differ
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "tree_run", **TREE)
    metrics = trainer.run()
    assert metrics["perf/nfe_sampling"] == (2 + 2 + 4 + 8) * 2
    assert metrics["perf/pairs_trained"] == 8 * 4
