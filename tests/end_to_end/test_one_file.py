"""examples/group_ppo_one_file.py, the main job's epoch in one file, against the package: its flat policy update trains
the weights the package's updater trains, bitwise, and the file runs as a user runs it."""

import importlib.util
import sys

import pytest
import torch

from helpers.launch_helpers import ROOT
from helpers.trainer_helpers import tiny_trainer


def one_file():
    spec = importlib.util.spec_from_file_location("group_ppo_one_file", ROOT / "examples" / "group_ppo_one_file.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flat_update_trains_the_weights_the_package_updater_trains(tiny_model_dir, tmp_path):
    """GROUP_PPO's batch of a tiny run (2 train batches, pairs in chunks of 6 across samples): from the same weights,
    optimizer state and random state, policy_update and PolicyUpdater.train_epoch end on the same weights, bitwise,
    and the same mean loss; the update moved them."""
    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "one_file", **{"sample.sde_window_size": 2})
    batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    trainer.rollouts.close()
    start = [p.detach().clone() for p in trainer.params]

    torch.manual_seed(11)
    package = trainer.updater.train_epoch(batch, show_progress=False)
    trained = [p.detach().clone() for p in trainer.params]
    with torch.no_grad():
        for param, value in zip(trainer.params, start):
            param.copy_(value)
    trainer.optimizer.optimizer.state.clear()  # the optimizer as it was before the package's update

    torch.manual_seed(11)
    loss = one_file().policy_update(trainer, batch)
    assert package["optimizer_steps"] == 2 and any(not torch.equal(a, b) for a, b in zip(start, trained))
    assert all(torch.equal(a, b.detach()) for a, b in zip(trained, trainer.params))
    assert loss == pytest.approx(package["policy_loss"], rel=1e-6)


def test_the_one_file_runs_the_main_job(tmp_path, monkeypatch, capsys):
    """``python examples/group_ppo_one_file.py --epochs 1`` on the embedded model (its main, in this process): the
    evaluation before and after the epoch, one line an epoch."""
    monkeypatch.setattr(sys, "argv", ["examples/group_ppo_one_file.py", "--epochs", "1", "--logdir", str(tmp_path),
                                      "--set", "sample.num_batches_per_epoch=1", "eval_num_seeds=2", "device=cpu"])
    one_file().main()
    out = capsys.readouterr().out
    line = [line for line in out.splitlines() if line.startswith("epoch 0: reward ")]
    assert len(line) == 1 and ", evaluation " in line[0], out[-2000:]
