"""ratio_norm in the update: the rollouts record the step means only for it, the first training forward's normalised
ratio is 1 on the real step functions (DDIM and flow), and an epoch on the tiny SD and SD3 models trains."""

import pytest
import torch

from ddpo_group.algorithms.policy_losses import ratio_norm_log_ratio
from ddpo_group.models import load_family
from ddpo_group.sampling.trajectories import SamplingOptions, TransitionScorer, sample_trajectories
from helpers.tolerances import reordered_sum_atol
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer
from helpers.batch_helpers import batch_of

RATIO_NORM = {"algorithm.policy_loss": "ratio_norm"}


@pytest.mark.parametrize("name", ["sd", "sd3"])
def test_the_first_training_forwards_normalised_ratio_is_one(name, family_model_dirs):
    """Scoring the recorded transitions under the sampling policy: the recorded means come back (bitwise within the
    sampling batch) and rho_hat is 1 to within 1e-6 in other chunk layouts (a hundredth of the default clip range
    1e-4), as the plain ratio is (tests/models/test_families.py): another batch size rounds the float32 kernels
    differently by a few ulps, and rho_hat multiplies that by the step's std, which is below 1."""
    config = tiny_config("grpo", family_model_dirs[name], "unused", **{**FAMILY_OVERRIDES[name], **RATIO_NORM,
                                                                        "sample.sde_window_size": 0})
    family = load_family(family_model_dirs[name], config=config)
    cond = family.encode(["a red circle", "a cat", "a blue square on green", "x"])
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    traj = sample_trajectories(family, family.model, cond, family.negative_condition(),
                               SamplingOptions(4, config.sample.guidance_scale, family.noise_levels(config.sample),
                                               record_means=True),
                               generator=gens)
    assert traj.means.shape == traj.latents[:, 1:].shape
    batch = batch_of(traj, cond)
    scorer = TransitionScorer.from_config(config, family)
    with torch.no_grad():
        for n in range(4):
            out = scorer(family.model, batch, torch.arange(4), torch.full((4,), n))
            assert torch.equal(out.mean, traj.means[:, n]) and bool((out.step_length > 0).all()), n
        rows, steps = torch.arange(4).repeat_interleave(4), torch.arange(4).repeat(4)
        for chunk in (16,):
            for c in torch.split(torch.arange(16), chunk):
                out = scorer(family.model, batch, rows[c], steps[c])
                log_ratio, _, _ = ratio_norm_log_ratio(traj.log_probs[rows[c], steps[c]], out.log_prob, out.mean,
                                                       traj.means[rows[c], steps[c]], out.std)
                assert float(log_ratio.abs().max()) < 1e-6, chunk


def test_the_step_lengths_add_up_to_the_flow_time_covered(family_model_dirs):
    """DDIM's step lengths on the equivalent flow time telescope to s(t_first) - s(t_final); the flow steps' to
    sigma_first - 0 = 1."""
    for name in ("sd", "sd3"):
        config = tiny_config("grpo", family_model_dirs[name], "unused", **FAMILY_OVERRIDES[name])
        family = load_family(family_model_dirs[name], config=config)
        cond = family.encode(["a cat"] * 2)
        traj = sample_trajectories(family, family.model, cond, family.negative_condition(),
                                   SamplingOptions(4, config.sample.guidance_scale, family.noise_levels(config.sample),
                                                   record_means=True),
                                   generator=[torch.Generator().manual_seed(i) for i in range(2)])
        batch = batch_of(traj, cond)
        scorer = TransitionScorer.from_config(config, family)
        with torch.no_grad():
            lengths = torch.stack([scorer(family.model, batch, torch.zeros(1, dtype=torch.long),
                                          torch.full((1,), n)).step_length[0] for n in range(4)])
        assert bool((lengths > 0).all()), name
        if name == "sd3":
            assert float(lengths.sum()) == pytest.approx(1.0, abs=1e-6)
        else:
            from ddpo_group.sampling.ddim import flow_time, step_alphas

            ab_first, _ = step_alphas(family.pipe.scheduler, traj.timesteps[0, :1])
            _, ab_final = step_alphas(family.pipe.scheduler, traj.timesteps[0, -1:])
            assert float(lengths.sum()) == pytest.approx(float(flow_time(ab_first) - flow_time(ab_final)), abs=1e-6)


@pytest.mark.parametrize("name", ["sd", "sd3"])
def test_an_epoch_with_ratio_norm_trains(name, family_model_dirs, tmp_path):
    trainer = tiny_trainer("grpo", family_model_dirs[name], tmp_path, f"ratio_norm_{name}",
                           **{**FAMILY_OVERRIDES[name], **RATIO_NORM})
    assert trainer.rollouts.sampler.options.record_means
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert metrics["global_step"] == 2
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    assert changed > len(before) // 2, f"only {changed} of {len(before)} trained tensors changed"
    for key in ("train/policy_loss", "train/grad_norm", "train/ratio_mean", "train/plain_ratio_mean",
                "train/mean_shift_bias"):
        assert torch.isfinite(torch.tensor(metrics[key])), (key, metrics[key])
    # one inner epoch, one train batch per optimizer step: the second batch is scored after one update, its means
    # moved from the rollout's (b, a mean square, > 0)
    assert metrics["train/mean_shift_bias"] > 0 and abs(metrics["train/ratio_mean"] - 1) < 0.1


def test_policy_gradient_rollouts_record_the_step_means_and_a_sampler_without_them_records_none(tiny_model_dir,
                                                                                                 tmp_path):
    from ddpo_group.rollout.reward_scorer import RewardScorer
    from ddpo_group.rollout.sampler import RolloutSampler

    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path)  # vanilla's ratio clip: the means for train/policy_kl
    assert trainer.config.algorithm.policy_loss == "vanilla" and trainer.rollouts.sampler.options.record_means
    trainer.rollouts.close()
    config, family = trainer.config, trainer.family
    score = RewardScorer(trainer.reward_fn, config.reward_fn)
    for record_means in (False, True):
        sampler = RolloutSampler(family, SamplingOptions.rollouts(config.sample, family, record_means=record_means),
                                 score)
        batch = sampler.sample(family.model, ["a cat"] * 8, [{}] * 8, desc=None)
        sampler.close()
        if record_means:
            assert batch.step_means.shape == batch.next_latents.shape
        else:
            assert batch.step_means is None


def test_the_chunked_ratio_norm_gradient_is_independent_of_the_chunk_size():
    """The update passes each chunk's current and recorded step means: pairs_per_forward 1 and 64 give one gradient,
    and with the policy moved away from the rollout policy the normalised ratio differs from 1."""
    from accelerate import Accelerator

    from config.base import get_config
    from ddpo_group.models.families.sd import StableDiffusionFamily, encode_prompts
    from ddpo_group.models.tiny_random import build_tiny_pipeline
    from ddpo_group.update.policy_update import PolicyUpdater
    from ddpo_group.update.updater import UpdateOptions

    torch.manual_seed(0)
    pipe = build_tiny_pipeline()
    config = get_config("grpo")
    config.sample.num_steps, config.train.clip_range, config.algorithm.policy_loss = 4, 0.2, "ratio_norm"
    family = StableDiffusionFamily(pipe, config)
    embeds, neg = encode_prompts(pipe, ["a cat", "a dog", "a cow"]), encode_prompts(pipe, [""])
    traj = sample_trajectories(family, pipe.unet, {"prompt_embeds": embeds}, family.negative_condition(),
                               SamplingOptions(4, config.sample.guidance_scale, [1.0] * 4, record_means=True),
                               generator=torch.Generator().manual_seed(1))
    batch = batch_of(traj, {"prompt_embeds": embeds}, step_means=traj.means, advantages=torch.tensor([[1.0], [-0.5], [2.0]]).expand(3, 4).clone())
    with torch.no_grad():
        for p in pipe.unet.parameters():
            p.add_(0.01 * torch.randn_like(p))
    step_mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    grads = []
    for pairs in (1, 64):
        config.train.pairs_per_forward = pairs
        updater = PolicyUpdater(UpdateOptions(config, Accelerator(cpu=True), pipe.unet, None,
                                              list(pipe.unet.parameters()), TransitionScorer.from_config(config, family)))
        pipe.unet.zero_grad()
        metrics = updater.accumulate_gradients(batch, torch.tensor([2, 0, 1]), step_mask)
        grads.append([p.grad.clone() for p in pipe.unet.parameters()])
        if pairs == 64:  # one chunk: its min and max are the batch's (chunks' metrics are averaged)
            assert float(metrics["ratio_max"]) > 1 > float(metrics["ratio_min"])
    terms = int(step_mask.sum()) * 2 * 64  # products per weight gradient: pairs, CFG branches, latent positions
    for chunked, whole in zip(*grads):
        torch.testing.assert_close(chunked, whole, rtol=1e-3, atol=reordered_sum_atol(whole, terms))
    assert any(g.abs().sum() > 0 for g in grads[0])
