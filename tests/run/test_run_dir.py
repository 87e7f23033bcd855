"""A run that stops before its first epoch finished leaves no run directory, unless the directory was there before
(a reused run name, a resume); a failure after that keeps everything and names the checkpoint (run/session.py)."""

from __future__ import annotations

import pytest

from helpers.trainer_helpers import tiny_trainer


def failing_from(trainer, monkeypatch, epoch: int) -> None:
    """Make every epoch from ``epoch`` on raise, as a reward service that went down would."""
    real = trainer.train_epoch

    def train_epoch(e):
        if e >= epoch:
            raise RuntimeError(f"reward service down at epoch {e}")
        return real(e)

    monkeypatch.setattr(trainer, "train_epoch", train_epoch)


def test_a_fresh_run_that_finishes_no_epoch_is_removed(tiny_model_dir, tmp_path, monkeypatch):
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=2)
    assert (tmp_path / "run" / "config.json").exists()  # written at start
    failing_from(trainer, monkeypatch, 0)
    with pytest.raises(RuntimeError, match="reward service down at epoch 0"):
        trainer.run()
    assert not (tmp_path / "run").exists()
    assert trainer.session.last_checkpoint_note() == (
        f"No epoch had finished, so the run directory {tmp_path / 'run'} was removed (it held only its config); "
        "start the run again.")


def test_a_run_directory_that_existed_before_is_kept(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=2)
    failing_from(trainer, monkeypatch, 0)
    with pytest.raises(RuntimeError):
        trainer.run()
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    assert trainer.session.last_checkpoint_note() == "No epoch had finished and no checkpoint was written."


@pytest.mark.slow
def test_after_an_epoch_everything_is_kept_and_the_note_says_what_runs_again(tiny_model_dir, tmp_path, monkeypatch):
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=5, save_freq=2)
    failing_from(trainer, monkeypatch, 3)  # epochs 0-2 finish, checkpoint after epoch 1
    with pytest.raises(RuntimeError):
        trainer.run()
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").read_text().count("\n") == 3
    assert trainer.session.last_checkpoint_note() == (
        f"The last complete checkpoint, {run / 'checkpoints' / 'checkpoint_00001'} (epoch 1), is kept. Epoch 2 "
        f"finished after it and runs again on resume. Resume with: python scripts/train.py "
        f"--config=config/base.py:ddpo --config.resume_from={run} (it continues from the newest checkpoint that verifies).")

    # a resumed run that fails at once keeps the directory it resumed
    resumed = tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=5, save_freq=2, resume_from=str(run))
    failing_from(resumed, monkeypatch, 0)
    with pytest.raises(RuntimeError):
        resumed.run()
    assert (run / "checkpoints" / "checkpoint_00001").is_dir()


@pytest.mark.slow
def test_no_checkpoint_yet_says_so_and_where_the_metrics_are(tiny_model_dir, tmp_path, monkeypatch):
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=5, save_freq=4)
    failing_from(trainer, monkeypatch, 2)
    with pytest.raises(RuntimeError):
        trainer.run()
    assert trainer.session.last_checkpoint_note() == (
        f"No checkpoint was written yet (epochs up to 1 finished; save_freq=4); their metrics are in "
        f"{tmp_path / 'run' / 'metrics.jsonl'}.")
