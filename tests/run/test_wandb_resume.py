"""A resumed run continues the same wandb run: the id is saved in every checkpoint and passed back to wandb."""

from __future__ import annotations

import accelerate

import ddpo_group.run.session as session_module
from helpers.trainer_helpers import tiny_trainer


def test_resume_passes_the_saved_wandb_run_id(tiny_model_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(session_module, "resolve_wandb_mode", lambda mode: ("offline", None))
    monkeypatch.setattr(accelerate.Accelerator, "init_trackers",
                        lambda self, project, config=None, init_kwargs=None: calls.append(init_kwargs["wandb"]))

    first = tiny_trainer("ddpo", tiny_model_dir, tmp_path, "a", save_freq=1)
    first.run()
    resumed = tiny_trainer("ddpo", tiny_model_dir, tmp_path, "a", num_epochs=2, resume_from=str(tmp_path / "a"))
    resumed.run()
    other = tiny_trainer("ddpo", tiny_model_dir, tmp_path, "b")
    other.rollouts.close()

    (a, a_again, b) = calls
    assert a["resume"] == a_again["resume"] == "allow"
    assert len(a["id"]) == 12 and a_again["id"] == a["id"] and b["id"] != a["id"]
    assert a["name"] == a_again["name"] == "a"
