import pytest
import torch
from accelerate import Accelerator

from ddpo_group.checkpointing import (
    TrainingState,
    complete_checkpoints,
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
