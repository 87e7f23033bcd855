import os
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from ddpo_group.run.checkpointing import (
    TrainingState,
    clear_leftovers,
    complete_checkpoints,
    later_checkpoints,
    resolve_resume_path,
    save_checkpoint,
)


def test_rotation_keeps_newest_complete_and_resume_finds_latest(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    state = TrainingState()
    accelerator.register_for_checkpointing(state)
    root = tmp_path / "run" / "checkpoints"
    for epoch in range(4):
        state.epoch, state.global_step = epoch, 10 * epoch
        save_checkpoint(accelerator, root, epoch, keep=2)
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00002", "checkpoint_00003"]
    assert not list(root.glob(".tmp_*"))

    # a crash mid-save leaves a temporary directory (and possibly an unmarked one): never resumed from
    (root / ".tmp_checkpoint_00004").mkdir()
    (root / "checkpoint_00005").mkdir()
    assert resolve_resume_path(str(tmp_path / "run")).name == "checkpoint_00003"
    assert resolve_resume_path(str(root / "checkpoint_00002")).name == "checkpoint_00002"

    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(str(resolve_resume_path(str(tmp_path / "run"))))
    assert state.epoch == 3 and state.global_step == 30
    assert model.weight.abs().sum() > 0


def test_resume_from_a_path_without_checkpoints_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_resume_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="neither a complete checkpoint nor a run directory"):
        resolve_resume_path(str(tmp_path))


def linear_state(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    state = TrainingState()
    accelerator.register_for_checkpointing(state)
    return accelerator, model, state, tmp_path / "run" / "checkpoints"


def half_written_save_state(original):
    """accelerate's save_state that writes the state, then cuts the model file in half and fails (disk full)."""

    def save_state(output_dir, **kwargs):
        original(output_dir, **kwargs)
        model_file = next(Path(output_dir).glob("model*.safetensors"))
        model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
        raise OSError(28, "No space left on device")

    return save_state


@pytest.mark.parametrize("fault", ["in save_state", "in extra files", "in the rename"])
def test_a_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, fault):
    accelerator, model, state, root = linear_state(tmp_path)
    with torch.no_grad():
        model.weight.fill_(1.0)
    state.epoch, state.global_step = 0, 5
    save_checkpoint(accelerator, root, 0, keep=1)

    with torch.no_grad():
        model.weight.fill_(2.0)
    state.epoch, state.global_step = 1, 9
    extra = None
    if fault == "in save_state":
        monkeypatch.setattr(accelerator, "save_state", half_written_save_state(accelerator.save_state))
    elif fault == "in extra files":
        def extra(directory):
            (directory / "lora").mkdir()
            raise RuntimeError("export failed")
    else:
        def replace(src, dst):
            raise OSError("rename failed")

        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises((OSError, RuntimeError)):
        save_checkpoint(accelerator, root, 1, keep=1, extra=extra)
    monkeypatch.undo()

    # keep=1 did not delete epoch 0: the failed save never completed
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00000"]
    resumed = resolve_resume_path(str(root.parent))
    assert resumed.name == "checkpoint_00000"
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(str(resumed))
    assert state.epoch == 0 and state.global_step == 5
    assert torch.equal(model.weight, torch.ones(2, 2))

    # the next save clears the leftovers and rotates normally
    state.epoch = 1
    save_checkpoint(accelerator, root, 1, keep=1)
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00001"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_00001"]


def test_resaving_an_epoch_restores_the_old_one_if_interrupted_and_rotation_keeps_the_new_one(tmp_path, monkeypatch):
    accelerator, model, state, root = linear_state(tmp_path)
    for epoch in range(4):
        state.epoch = epoch
        save_checkpoint(accelerator, root, epoch, keep=5)
    # a resume from epoch 1 saves epoch 2 again while checkpoint_00003 (an abandoned attempt) exists; keep=1
    state.epoch, state.global_step = 2, 77
    save_checkpoint(accelerator, root, 2, keep=1)
    names = [p.name for p in complete_checkpoints(root)]
    assert names == ["checkpoint_00002", "checkpoint_00003"]  # never the checkpoint just written
    assert later_checkpoints(root / "checkpoint_00002") == [root / "checkpoint_00003"]
    accelerator.load_state(str(root / "checkpoint_00002"))
    assert state.global_step == 77

    # a crash between moving the old epoch-2 checkpoint aside and renaming the new one into place
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).name == "checkpoint_00002":
            raise OSError("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    state.global_step = 88
    with pytest.raises(OSError):
        save_checkpoint(accelerator, root, 2, keep=5)
    monkeypatch.undo()
    assert calls == [".replaced_checkpoint_00002", "checkpoint_00002"]
    assert not (root / "checkpoint_00002").exists()  # hidden aside, not lost:
    clear_leftovers(root)
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00002", "checkpoint_00003"]
    accelerator.load_state(str(root / "checkpoint_00002"))
    assert state.global_step == 77


def test_a_crash_while_rotating_never_leaves_a_half_deleted_complete_checkpoint(tmp_path, monkeypatch):
    accelerator, model, state, root = linear_state(tmp_path)
    save_checkpoint(accelerator, root, 0, keep=1)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name == ".deleting_checkpoint_00000" and Path(path).exists():  # killed after deleting one file
            next(Path(path).glob("model*.safetensors")).unlink()
            raise OSError("killed")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(OSError):
        save_checkpoint(accelerator, root, 1, keep=1)
    monkeypatch.undo()
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00001"]
    assert resolve_resume_path(str(root.parent)).name == "checkpoint_00001"
