"""Ctrl-C / SIGTERM in-process (real signals to this process): clean stop, a checkpoint, a non-zero exit code.

The subprocess version with exact resume is in test_exact_resume.py.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from ddpo_group.run.persistence.checkpointing import complete_checkpoints
from ddpo_group.errors import TrainingInterrupted
from helpers.trainer_helpers import tiny_trainer


def epochs_logged(run_dir) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def signal_during(trainer, monkeypatch, method_owner, name: str, epoch_of, at_epoch: int, signals):
    """Send ``signals`` to this process when ``method_owner.name`` runs during epoch ``at_epoch``."""
    real = getattr(method_owner, name)

    def wrapped(*args, **kwargs):
        if epoch_of() == at_epoch:
            for sig in signals:
                os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(method_owner, name, wrapped)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_updating_finishes_the_epoch_checkpoints_and_exits_nonzero(sig, tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    previous = signal.getsignal(sig)
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=4, save_freq=3)
    signal_during(trainer, monkeypatch, trainer.updater, "train_epoch", lambda: trainer.state.epoch + 1, 1, [sig])
    with pytest.raises(TrainingInterrupted) as caught:
        trainer.run()
    name = signal.Signals(sig).name
    assert caught.value.exit_code == 128 + sig
    assert str(caught.value).startswith(f"training stopped by {name} after epoch 1; checkpoint ")
    assert f"--config.resume_from={tmp_path / 'run'}" in str(caught.value)
    assert epochs_logged(tmp_path / "run") == [0, 1]
    assert [p.name for p in complete_checkpoints(tmp_path / "run" / "checkpoints")] == ["checkpoint_00001"]
    assert signal.getsignal(sig) is previous  # handlers restored

    resumed = tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=4, save_freq=3, resume_from=str(tmp_path / "run"))
    assert resumed.state.epoch == 1 and resumed.state.global_step == 4
    resumed.rollouts.close()


def test_a_second_signal_stops_at_once_and_keeps_the_last_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=3, save_freq=1)
    signal_during(trainer, monkeypatch, trainer.updater, "train_epoch", lambda: trainer.state.epoch + 1, 1,
                  [signal.SIGTERM, signal.SIGTERM])
    with pytest.raises(TrainingInterrupted, match="stopped at once by a second SIGTERM; no checkpoint of the unfinished"):
        trainer.run()
    assert epochs_logged(tmp_path / "run") == [0]
    assert [p.name for p in complete_checkpoints(tmp_path / "run" / "checkpoints")] == ["checkpoint_00000"]


def test_a_signal_while_sampling_the_first_epoch_leaves_nothing_to_resume(tiny_model_dir, tmp_path, monkeypatch):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, num_epochs=2)
    signal_during(trainer, monkeypatch, trainer.prompt_sampler, "sample_epoch", lambda: 0, 0, [signal.SIGTERM])
    with pytest.raises(TrainingInterrupted, match="while sampling epoch 0; the epoch was dropped before any update. "
                                                  "No epoch had finished, so there is nothing to checkpoint"):
        trainer.run()
    assert not (tmp_path / "run").exists()  # it held only config.json: no orphan run directory
    assert trainer.state.global_step == 0
