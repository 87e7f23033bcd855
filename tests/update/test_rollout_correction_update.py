"""algorithm.rollout_correction in the update (update/policy_update.py): with the sampler and the trainer alike it
changes nothing (rejection keeps every pair: the update bitwise the recompute's alone; the weights are 1 to rounding);
with a training forward that differs from the sampler (another guidance scale) it weighs and rejects pairs, per step
and per trajectory (a trajectory-level loss too), and logs how much."""

import pytest
import torch

from helpers.trainer_helpers import tiny_trainer


def trained(model_dir, tmp_path, name, differ=False, **fields):
    """A one-epoch tiny grpo run (its metrics, its trained weights); ``differ``: the training forward guides at another
    scale than the sampler, so every recorded log-probability is off the trainer's."""
    trainer = tiny_trainer("grpo", model_dir, tmp_path, name, device="cpu", **fields)
    if differ:
        trainer.scorer.guidance_scale = trainer.config.sample.guidance_scale + 2.0
    trainer.on_policy.say = lambda line: None
    metrics = trainer.run()
    return metrics, [p.detach().clone() for p in trainer.params]


def test_a_sampler_like_the_trainer_is_left_as_it_was(tiny_model_dir, tmp_path):
    base, base_weights = trained(tiny_model_dir, tmp_path, "recompute", **{"train.recompute_rollout": True})
    band, band_weights = trained(tiny_model_dir, tmp_path, "band", **{
        "algorithm.rollout_correction.rs_level": "step", "algorithm.rollout_correction.rs_threshold": 1.01})
    assert band["train/rollout_rs_masked"] == 0.0 and band["train/rollout_log_ratio_abs"] < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(base_weights, band_weights))
    weighed, weighed_weights = trained(tiny_model_dir, tmp_path, "weighed", **{
        "algorithm.rollout_correction.is_level": "trajectory"})
    assert weighed["train/rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert weighed["train/rollout_is_weight_std"] < 1e-5 and weighed["train/rollout_is_truncated"] == 0.0
    assert weighed["train/policy_loss"] == pytest.approx(base["train/policy_loss"], rel=1e-4, abs=1e-9)


def test_a_differing_trainer_is_weighed_and_rejected(tiny_model_dir, tmp_path):
    off, _ = trained(tiny_model_dir, tmp_path, "off", differ=True, **{"train.recompute_rollout": True})
    step, step_weights = trained(tiny_model_dir, tmp_path, "step", differ=True, **{
        "algorithm.rollout_correction.is_level": "step", "algorithm.rollout_correction.is_threshold": 1.0,
        "algorithm.rollout_correction.rs_level": "step", "algorithm.rollout_correction.rs_threshold": 1.001})
    # every pair's ratio away from 1: the band drops some, the cap at 1 truncates others, the rest weigh below 1
    assert step["train/rollout_log_ratio_abs"] > 1e-4 and step["train/rollout_recomputed_kl"] > 1e-5
    assert 0.0 < step["train/rollout_rs_masked"] < 1.0 and step["train/rollout_is_truncated"] > 0.0
    assert step["train/rollout_is_weight_mean"] < 1.0 and step["train/rollout_is_weight_std"] > 0.0
    assert step["train/ratio_before_update"] < 1e-5  # the loss's ratios start from the recomputed log-probs
    assert all(torch.isfinite(p).all() for p in step_weights) and off["train/policy_loss"] != 0.0
    # a band no pair is inside: every pair rejected, no policy loss left
    none, _ = trained(tiny_model_dir, tmp_path, "none", differ=True, **{
        "algorithm.rollout_correction.rs_level": "step", "algorithm.rollout_correction.rs_threshold": 1.000000001})
    assert none["train/rollout_rs_masked"] == 1.0 and none["train/policy_loss"] == 0.0
    # a trajectory-level loss: its rows' advantages weighed, its rejected trajectories masked
    gspo, _ = trained(tiny_model_dir, tmp_path, "gspo", differ=True, **{
        "algorithm.policy_loss": "gspo", "algorithm.rollout_correction.is_level": "trajectory",
        "algorithm.rollout_correction.rs_level": "trajectory", "algorithm.rollout_correction.rs_threshold": 1.001})
    assert 0.0 < gspo["train/rollout_rs_masked"] <= 1.0 and torch.isfinite(torch.tensor(gspo["train/policy_loss"]))
