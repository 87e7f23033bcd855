"""Every preset runs one short epoch on the tiny random model and changes the trained weights."""

import pytest
import torch

from config.base import PRESETS
from helpers.trainer_helpers import tiny_trainer


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_runs_one_epoch_and_changes_weights(preset, tiny_model_dir, tmp_path):
    trainer = tiny_trainer(preset, tiny_model_dir, tmp_path, preset)
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert metrics["reward_count"] == 8 and metrics["global_step"] == 2
    assert metrics["reward_queries"] == (16 if preset == "remax" else 8)  # remax: + one greedy sample per group
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    assert changed > len(before) // 2, f"{preset}: only {changed} of {len(before)} trained tensors changed"
    for key in ("adv/mean", "train/policy_loss", "train/grad_norm"):
        assert torch.isfinite(torch.tensor(metrics[key])), (preset, key, metrics[key])
    if trainer.critic is not None:
        assert metrics["critic/value_loss"] > 0
    if trainer.kl is not None:  # in the loss: the second train batch's, after one update (> 0); in the reward: the
        # rollouts', sampled by the untrained policy (LoRA B = 0), which is the reference (0)
        assert "ref/param_distance" in metrics
        if trainer.kl.in_loss:
            assert metrics["ref/kl"] > 1e-4
        else:
            assert metrics["ref/kl"] == pytest.approx(0.0, abs=1e-6)
    if preset == "group_ppo":
        for key in ("segment/tau", "segment/compression_ratio", "segment/num_endpoints", "segment/critic_ev", "critic/clipfrac"):
            assert key in metrics
