"""DAPO's dynamic sampling: constant-reward groups are dropped, more rounds fill the batch, the share is logged."""

import pytest
import torch

from ddpo_group.algorithms import zero_variance_group_filter
from ddpo_group.rollout.collector import pool_rows
from ddpo_group.rewards import REWARD_REGISTRY, register_reward
from helpers.batch_helpers import rollout_batch
from helpers.trainer_helpers import tiny_trainer

if "test_half_constant" not in REWARD_REGISTRY:

    @register_reward("test_half_constant")
    def half_constant():
        """Prompts of even length score 0 whatever the image (their groups carry no signal); others the image mean."""

        def fn(images, prompts, metadata):
            signal = torch.tensor([len(p) % 2 for p in prompts], dtype=torch.float64, device=images.device)
            return signal * images.double().mean(dim=(1, 2, 3)), {}

        return fn


def test_keep_mask_and_pooling():
    keep, share = zero_variance_group_filter(torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, True, True, False, False] and share == 2 / 3
    def batch(start, prompts):
        latents = torch.arange(start, start + 4.0)[:, None, None].expand(4, 2, 3)
        return rollout_batch({"prompt_embeds": latents}, latents, latents + 1, torch.zeros(4, 2),
                             {"timesteps": torch.ones(4, 2)}, prompts=list(prompts), advantages=torch.zeros(4, 2))

    keeps = [torch.tensor([False, True, False, False]), torch.tensor([True, False, True, False])]
    pooled = pool_rows([batch(0, "abcd"), batch(10, "efgh")], keeps, 4)
    assert pooled.latents[:, 0, 0].tolist() == [1, 10, 12, 0] and pooled.prompts == ["b", "e", "g", "a"]
    assert torch.equal(pooled.next_latents, pooled.latents + 1) and torch.equal(pooled.cond["prompt_embeds"],
                                                                                pooled.latents)
    assert pooled.advantages.shape == (4, 2) and pooled.times["timesteps"].shape == (4, 2)
    assert pooled.row_mask.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_trainer_drops_constant_groups_and_samples_more(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "dapo", **{
        "reward_fn": "test_half_constant", "algorithm.filter_groups": True, "algorithm.max_num_gen_batches": 4,
        "train.group_size": 2})
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert 0 < metrics["filter/dropped_share"] < 1
    assert metrics["filter/rounds"] >= 2 and metrics["reward_count"] == 8 * metrics["filter/rounds"]
    assert metrics["filter/batch_fill"] == 1.0 or metrics["filter/rounds"] == 4
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))


def test_same_initial_noise_shares_x_0_within_each_group_only(tiny_model_dir, tmp_path):
    def initial_latents(same: bool):
        trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, f"noise_{same}", **{"sample.same_initial_noise": same})
        batch = trainer.rollouts.estimate_round(trainer.rollouts.sample_round(0, 0)).batch
        trainer.rollouts.close()
        return batch

    shared, independent = initial_latents(True), initial_latents(False)
    x_0 = shared.latents[:, 0].flatten(1)
    same = torch.cdist(x_0, x_0) == 0  # [8, 8]: rows with the same x_0
    # 8 samples = 2 groups of 4: each row shares x_0 with exactly its 3 copies, which have its prompt
    assert same.sum(1).tolist() == [4] * 8
    prompts = shared.prompts
    assert all(prompts[i] == prompts[j] for i in range(8) for j in range(8) if same[i, j])
    # the step noise still differs: the copies' next latents are not equal
    first_step = shared.next_latents[:, 0].flatten(1)
    assert (torch.cdist(first_step, first_step) > 0).sum() == 8 * 7
    # without the option every sample has its own x_0
    x_0 = independent.latents[:, 0].flatten(1)
    assert ((torch.cdist(x_0, x_0) == 0).sum(1) == 1).all()


def test_remax_greedy_baseline_starts_from_the_groups_shared_x_0(tiny_model_dir, tmp_path):
    from ddpo_group.rollout.reward_scorer import RewardScorer
    from ddpo_group.models.families.sd import encode_prompts
    from helpers.sd_helpers import sd_trajectories

    # on the CPU: the baseline is recomputed in another batch and compared to float precision (a GPU's kernels
    # depend on the batch size, and the JPEG reward turns the smallest pixel change into whole bytes)
    trainer = tiny_trainer("remax", tiny_model_dir, tmp_path, "remax_noise", **{"sample.same_initial_noise": True,
                                                                               "device": "cpu"})
    round0 = trainer.rollouts.estimate_round(trainer.rollouts.sample_round(0, 0))
    batch, config = round0.batch, trainer.config
    x_0 = batch.latents[:, 0]  # the DDIM scheduler's init_noise_sigma is 1
    with torch.no_grad():
        greedy = sd_trajectories(
            trainer.pipe, encode_prompts(trainer.pipe, batch.prompts), trainer.family.negative_condition()["prompt_embeds"].expand(8, -1, -1),
            config.sample.num_steps, config.sample.guidance_scale, eta=0.0, compute_log_prob=False, initial_noise=x_0,
        )
    want, _ = RewardScorer(trainer.reward_fn, config.reward_fn)(greedy.images, batch.prompts, batch.metadata)
    torch.testing.assert_close(round0.gathered.greedy_rewards, want)
    trainer.rollouts.close()


@pytest.mark.parametrize("preset", ["grpo", "reinforce_pp"])
def test_sde_window_samples_and_trains_only_its_steps(preset, tiny_model_dir, tmp_path, monkeypatch):
    import ddpo_group.update.policy_update as policy_update

    trainer = tiny_trainer(preset, tiny_model_dir, tmp_path, "window", **{
        "sample.sde_window_start": 1, "sample.sde_window_size": 2})
    round0 = trainer.rollouts.estimate_round(trainer.rollouts.sample_round(0, 0))
    batch = round0.batch
    assert (batch.log_probs[:, [0, 3]] == 0).all() and (batch.log_probs[:, 1:3] != 0).all()
    if preset == "reinforce_pp":  # KL in the reward: deterministic steps are no action, so no KL
        assert (round0.gathered.step_kl[:, [0, 3]] == 0).all()
    trained_steps = []
    original = policy_update.PolicyUpdater.chunks

    def spy(self, batch, rows, step_mask, *args, **kwargs):
        trained_steps.append(step_mask.sum(0))
        return original(self, batch, rows, step_mask, *args, **kwargs)

    monkeypatch.setattr(policy_update.PolicyUpdater, "chunks", spy)
    before = [p.detach().clone() for p in trainer.updater.params]
    trainer.run()
    per_step = torch.stack(trained_steps).sum(0)
    assert per_step[[0, 3]].sum() == 0 and per_step[1:3].sum() == 2 * 8  # both window steps of the 8 samples
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
