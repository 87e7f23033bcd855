"""Algorithm plugins: an estimator and a policy loss defined in a file outside the package, named by path in the
config, with their keywords from algorithm.*_kwargs and their needs declared by the decorator."""

import textwrap

import pytest
import torch
from accelerate import Accelerator

from ddpo_group.algorithms import AdvantageInputs, get_adv_estimator, get_policy_loss
from ddpo_group.errors import ConfigError
from ddpo_group.run.config_checks import validate_config
from ddpo_group.models.families.sd import StableDiffusionFamily, encode_prompts
from ddpo_group.sampling.trajectories import TransitionScorer
from ddpo_group.update.policy_update import PolicyUpdater
from ddpo_group.update.updater import UpdateOptions
from ddpo_group.models.tiny_random import build_tiny_pipeline
from helpers.batch_helpers import batch_of
from helpers.sd_helpers import sd_trajectories
from helpers.tolerances import reordered_sum_atol
from helpers.trainer_helpers import tiny_config, tiny_trainer

ESTIMATOR = textwrap.dedent('''
    import torch
    from ddpo_group.algorithms import AdvantageOutput, adv_estimator

    CALLS = []

    @adv_estimator(needs_groups=True)
    def scaled_baseline(inputs, scale=1.0):
        """A_i = scale * (R_i - mean_g): one parameter, read from algorithm.adv_estimator_kwargs."""
        CALLS.append(scale)
        R, g = inputs.rewards.double(), inputs.group_index
        mean = torch.zeros(int(g.max()) + 1, dtype=R.dtype).index_add_(0, g, R) / torch.bincount(g).to(R.dtype)
        A = scale * (R - mean[g])
        return AdvantageOutput(A[:, None].expand_as(inputs.step_mask).clone())
''')

LOSSES = textwrap.dedent('''
    from ddpo_group.algorithms import agg_loss, policy_loss

    PER_STEP_CALLS = []

    @policy_loss(per_step=True)
    def linear(rollout_log_prob, log_prob, advantages, weights, weight=1.0, **_):
        PER_STEP_CALLS.append(log_prob.shape)
        return (weights * -weight * advantages * (log_prob - rollout_log_prob)).sum(), {}

    def linear_whole(rollout_log_prob, log_prob, advantages, step_mask, loss_agg_mode="step-mean", weight=1.0, **_):
        """The same loss, trajectory-level (undecorated): the update gathers the train batch's log-probs."""
        return agg_loss(-weight * advantages * (log_prob - rollout_log_prob), step_mask, loss_agg_mode), {}
''')


@pytest.fixture
def plugin_files(tmp_path):
    (tmp_path / "my_estimator.py").write_text(ESTIMATOR)
    (tmp_path / "my_losses.py").write_text(LOSSES)
    return tmp_path


def test_a_file_estimator_with_a_parameter_trains_one_epoch(plugin_files, tiny_model_dir, tmp_path):
    spec = f"{plugin_files / 'my_estimator.py'}:scaled_baseline"
    estimator = get_adv_estimator(spec)
    assert estimator.needs_groups and not estimator.needs_critic and not estimator.accepts_step_rewards
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "plugin", **{
        "algorithm.adv_estimator": spec, "algorithm.adv_estimator_kwargs": {"scale": 2.5}, "train.adv_clip_max": 1e9})
    module = __import__(estimator.fn.__module__)
    round0 = trainer.rollouts.estimate_round(trainer.rollouts.sample_round(0, 0))
    assert module.CALLS == [2.5]  # the keyword from adv_estimator_kwargs
    rewards, g = round0.gathered.rewards, torch.tensor(round0.groups)
    mean = torch.stack([rewards[g == k].mean() for k in range(int(g.max()) + 1)])
    want = (2.5 * (rewards - mean[g])).float()[:, None].expand(8, 4)
    torch.testing.assert_close(round0.batch.advantages.cpu(), want, rtol=1e-6, atol=1e-7)
    trainer.rollouts.close()

    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "plugin_run", **{
        "algorithm.adv_estimator": spec, "algorithm.adv_estimator_kwargs": {"scale": 2.5}})
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and abs(metrics["adv/mean"]) < 1e-6
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))


def test_declared_needs_are_checked_at_start_and_on_the_inputs(plugin_files):
    spec = f"{plugin_files / 'my_estimator.py'}:scaled_baseline"
    config = tiny_config("ddpo", "unused", "unused", **{"algorithm.adv_estimator": spec})  # group_size 1
    with pytest.raises(ConfigError, match=r"scaled_baseline' compares the samples of a prompt group .*group_size >= 2"):
        validate_config(config)
    with pytest.raises(ValueError, match="at least 2 samples per prompt group"):
        get_adv_estimator(spec)(AdvantageInputs(torch.ones(3), torch.ones(3, 2), torch.tensor([0, 0, 1])))
    with pytest.raises(ValueError, match="cannot take step_rewards"):
        get_adv_estimator(spec)(AdvantageInputs(torch.ones(2), torch.ones(2, 2), torch.tensor([0, 0]),
                                                step_rewards=torch.zeros(2, 2)))
    config.algorithm.adv_estimator = f"{plugin_files / 'missing.py'}:scaled_baseline"
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator=.*missing.py:scaled_baseline.*does not exist"):
        validate_config(config)


def _updater(config, pipe):
    neg = encode_prompts(pipe, [""])
    return PolicyUpdater(UpdateOptions(config, Accelerator(cpu=True), pipe.unet, None, list(pipe.unet.parameters()),
                                       TransitionScorer.from_config(config, StableDiffusionFamily(pipe, config)))), neg


def test_a_file_per_step_policy_loss_takes_the_chunked_update(plugin_files):
    """A loss declared per step is backpropagated chunk by chunk (pairs_per_forward at a time); the same loss
    trajectory-level gathers the batch's log-probs; both give the same gradient, with the weight from
    policy_loss_kwargs."""
    torch.manual_seed(0)
    pipe = build_tiny_pipeline()
    grads, calls = [], []
    for name in ("linear", "linear_whole"):
        config = tiny_config("ddpo", "unused", "unused", **{
            "algorithm.policy_loss": f"{plugin_files / 'my_losses.py'}:{name}", "algorithm.policy_loss_kwargs": {"weight": 3.0},
            "sample.num_steps": 3, "train.pairs_per_forward": 2, "sample.guidance_scale": 1.0, "train.cfg": False})
        updater, neg = _updater(config, pipe)
        module = __import__(get_policy_loss(config.algorithm.policy_loss).fn.__module__)
        module.PER_STEP_CALLS.clear()
        embeds = encode_prompts(pipe, ["a cat", "a dog"])
        traj = sd_trajectories(pipe, embeds, neg.expand(2, -1, -1), 3, 1.0, 1.0, decode=False,
                               generator=torch.Generator().manual_seed(0))
        batch = batch_of(traj, {"prompt_embeds": embeds}, advantages=torch.tensor([[1.0], [-2.0]]).expand(2, 3))
        pipe.unet.zero_grad()
        updater.accumulate_gradients(batch, torch.arange(2), torch.ones(2, 3))
        grads.append([p.grad.clone() for p in pipe.unet.parameters() if p.grad is not None])
        calls.append(list(module.PER_STEP_CALLS))
    assert calls[0] == [torch.Size([2])] * 3  # 6 pairs, 2 per forward: three chunks, each through the loss
    assert calls[1] == []
    # each weight's gradient sums one product per pair (6, no CFG) and latent position (8 x 8), in another order
    assert grads[0] and all(torch.allclose(a, b, rtol=1e-4, atol=reordered_sum_atol(b, 6 * 64)) for a, b in zip(*grads))
    assert any(g.abs().sum() > 0 for g in grads[0])
