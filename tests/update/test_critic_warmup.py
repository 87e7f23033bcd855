"""critic.warmup_epochs: the first epochs train the critic only; the policy's weights stay bitwise, the critic's loss
falls, and the policy trains from the epoch after."""

import torch

from helpers.trainer_helpers import tiny_trainer


def test_warmup_epochs_train_the_critic_only(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, **{
        "num_epochs": 4, "critic.warmup_epochs": 3, "critic.learning_rate": 1e-2, "critic.num_updates": 4})
    start = [p.detach().clone() for p in trainer.updater.params]
    losses = []
    for epoch in range(3):
        metrics = trainer.train_epoch(epoch)
        losses.append(metrics["critic/value_loss"])
        assert metrics["global_step"] == 0 and metrics["perf/pairs_trained"] == 0
        assert all(torch.equal(a, p.detach()) for a, p in zip(start, trainer.updater.params))
    # the rewards (jpeg compressibility, about -0.86) are far from the untrained critic's ~0: it learns the level
    assert losses[2] < 0.5 * losses[0], losses
    metrics = trainer.train_epoch(3)
    assert metrics["global_step"] > 0 and any(not torch.equal(a, p.detach()) for a, p in zip(start, trainer.updater.params))
