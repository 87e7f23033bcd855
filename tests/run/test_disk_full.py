"""A full disk while a checkpoint or a metrics line is written: a WriteError naming the file, the previous checkpoint
intact and resumable, metrics.jsonl as it was.

The disk fills for real where it can: the file at fault is opened on /dev/full, so the kernel's ENOSPC reaches
torch's or Python's own writer as it would on a full filesystem; safetensors' save_file (a temporary file renamed into
place) raises what it raises on a full tmpfs. The training runs stop the same way through the reward plugin
tests/plugins/write_faults.py (WRITE_FAULTS_DO=disk-full).
"""

from __future__ import annotations

import errno
import os
from collections import namedtuple
from pathlib import Path

import accelerate.utils.other as accelerate_other
import pytest
import torch
from accelerate import Accelerator
from safetensors import SafetensorError

from ddpo_group.run.persistence import metrics_log, state_files, write_errors
from ddpo_group.run.persistence.checkpointing import (
    TrainingState,
    checkpoint_problem,
    complete_checkpoints,
    load_checkpoint,
    resolve_resume_path,
    save_checkpoint,
)
from ddpo_group.run.persistence.metrics_log import append_metrics, read_metrics
from ddpo_group.run.persistence.write_errors import WriteError, describe_write_error
from test_exact_resume import environment, finish, start, train_command

DEV_FULL = Path("/dev/full")
DiskUsage = namedtuple("DiskUsage", "total used free")
needs_dev_full = pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full on this system")
WRITE_FAULTS = f"{Path(__file__).resolve().parents[1] / 'plugins' / 'write_faults.py'}:make"

# each file of a checkpoint: what the error says it holds, and whether it names the file (else its directory)
ACCELERATE = "accelerate's state: the weights, the optimizer, the random states"
CHECKPOINT_FILES = {
    "model.safetensors": (ACCELERATE, False),
    "optimizer.bin": (ACCELERATE, False),
    "random_states_0.pkl": (ACCELERATE, False),
    "training_state.safetensors": ("the training state's tensors", True),
    "training_state.json": ("the training state", True),
    "state_fields.json": ("the files the run adds to a checkpoint", False),
    "COMPLETE": ("the marker of a complete checkpoint", True),
    "MANIFEST.json": ("the checkpoint's manifest", True),
}


def trained_model(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return accelerator, model, tmp_path / "run" / "checkpoints"


def fill_the_disk_at(name: str, accelerator, monkeypatch) -> None:
    """The next save's file ``name`` fails as on a full filesystem."""
    if name == "model.safetensors":
        monkeypatch.setattr(accelerate_other, "safe_save_file", safetensors_on_a_full_disk)
        return
    if name == "training_state.safetensors":
        monkeypatch.setattr(state_files, "save_file", safetensors_on_a_full_disk)
        return
    if name.endswith((".bin", ".pkl")):  # torch.save keeps no errno: a full filesystem has no free space left
        monkeypatch.setattr(write_errors.shutil, "disk_usage", lambda path: DiskUsage(1 << 30, 1 << 30, 0))
    real_save_state = accelerator.save_state

    def save_state_on_a_full_disk(output_dir, **kwargs):  # the file ``name`` of this save goes to /dev/full
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / name).symlink_to(DEV_FULL)
        return real_save_state(output_dir, **kwargs)

    monkeypatch.setattr(accelerator, "save_state", save_state_on_a_full_disk)


def safetensors_on_a_full_disk(tensors, filename, *args, **kwargs):
    """What safetensors' save_file raises on a full filesystem (it writes a temporary file, then renames it into
    place: /dev/full cannot stand in for it)."""
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def add_state_fields(directory: Path) -> None:
    (directory / "state_fields.json").write_text("{}\n")


@needs_dev_full
@pytest.mark.parametrize("name", sorted(CHECKPOINT_FILES))
def test_a_full_disk_while_saving_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, name):
    accelerator, model, root = trained_model(tmp_path)
    state = TrainingState()
    state.epoch, state.global_step = 0, 5
    save_checkpoint(accelerator, root, 0, keep=1, pieces={"counters": state}, extra=add_state_fields)
    saved_weight = model.weight.detach().clone()
    assert name in {p.name for p in (root / "checkpoint_00000").iterdir()}

    fill_the_disk_at(name, accelerator, monkeypatch)
    with torch.no_grad():
        model.weight.add_(1.0)
    state.epoch, state.global_step = 1, 9
    with pytest.raises(WriteError) as failed:
        save_checkpoint(accelerator, root, 1, keep=1, pieces={"counters": state}, extra=add_state_fields)
    monkeypatch.undo()

    message = str(failed.value)
    what, names_the_file = CHECKPOINT_FILES[name]
    at_fault = root / ".tmp_checkpoint_00001" / name if names_the_file else root / ".tmp_checkpoint_00001"
    assert message.startswith(f"no space left on device: {at_fault} ({what}) could not be written;"), message
    assert message.endswith("; checkpoint_00001 was not saved (its unfinished files are removed)")
    assert "\n" not in message

    # the unfinished checkpoint is gone, the previous one verifies and resumes
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_00000"]
    assert checkpoint_problem(root / "checkpoint_00000") is None
    resumed, skipped = resolve_resume_path(str(root.parent))
    assert resumed == root / "checkpoint_00000" and skipped == []
    load_checkpoint(accelerator, resumed, {"counters": state})
    assert state.epoch == 0 and state.global_step == 5 and torch.equal(model.weight, saved_weight)


def test_a_write_error_says_no_space_left_when_the_disk_is_full(tmp_path, monkeypatch):
    torch_error = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
    assert describe_write_error(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "a", "a file") == \
        f"no space left on device: {tmp_path / 'a'} (a file) could not be written"
    assert describe_write_error(OSError(errno.EACCES, "Permission denied"), tmp_path / "a", "a file") == \
        f"{tmp_path / 'a'} (a file) could not be written: PermissionError: [Errno 13] Permission denied"
    # torch.save keeps no errno: the free space left tells (under 1 MiB after a failed write: full)
    assert describe_write_error(torch_error, tmp_path / "a", "a file").startswith(
        f"{tmp_path / 'a'} (a file) could not be written: RuntimeError: [enforce fail")
    monkeypatch.setattr(write_errors.shutil, "disk_usage", lambda path: DiskUsage(1 << 30, (1 << 30) - 4096, 4096))
    assert describe_write_error(torch_error, tmp_path / "missing" / "a", "a file").startswith(
        "no space left on device: ")


class HalfThenFull:
    """What append_metrics opens on a disk that fills up: the first write takes half its bytes, the next fails."""

    def __init__(self, path, mode, buffering=-1):
        self.file = open(path, mode, buffering=buffering)
        self.wrote = False

    def write(self, data):
        if self.wrote:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.wrote = True
        return self.file.write(bytes(data)[: len(data) // 2])

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_a_full_disk_while_appending_metrics_leaves_the_log_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    for epoch in range(2):
        append_metrics(path, {"epoch": epoch, "reward_mean": epoch / 10})
    before = path.read_bytes()
    monkeypatch.setattr(metrics_log, "open", HalfThenFull, raising=False)
    with pytest.raises(WriteError) as failed:
        append_metrics(path, {"epoch": 2, "reward_mean": 0.2})
    monkeypatch.undo()
    assert str(failed.value) == (f"no space left on device: {path} (the metrics of epoch 2) could not be written; "
                                 "the line is not added")
    assert path.read_bytes() == before  # the half line written before the failure is taken back
    append_metrics(path, {"epoch": 2, "reward_mean": 0.25})
    assert [(r["epoch"], r["reward_mean"]) for r in read_metrics(path)] == [(0, 0.0), (1, 0.1), (2, 0.25)]


def test_a_line_cut_by_a_kill_is_skipped_and_the_next_line_starts_a_line_of_its_own(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_metrics(path, {"epoch": 0, "reward_mean": 0.0})
    with open(path, "a") as f:
        f.write('{"epoch": 1, "reward_me')  # SIGKILL in the middle of a write
    assert [r["epoch"] for r in read_metrics(path)] == [0]
    append_metrics(path, {"epoch": 1, "reward_mean": 0.1})  # the run started again in the same directory
    assert [(r["epoch"], r["reward_mean"]) for r in read_metrics(path)] == [(0, 0.0), (1, 0.1)]


# ------------------------------------------------------------------------------------ a training run on a full disk


def stderr_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("[ddpo_group]")]


@needs_dev_full
@pytest.mark.slow
@pytest.mark.parametrize("where", ["checkpoint", "metrics"])
def test_a_training_run_on_a_full_disk_stops_with_one_line_and_resumes_from_the_previous_checkpoint(
        where, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    command = train_command("ddpo", tiny_model_dir, tmp_path, "run", num_epochs=3, save_freq=1, reward_fn=WRITE_FAULTS)
    # the file of checkpoint_00001 written after accelerate's, or the second metrics line (epoch 1's)
    match, nth = (".tmp_checkpoint_00001/training_state.json", 1) if where == "checkpoint" else ("metrics ", 2)
    log = tmp_path / "full.log"
    env = environment(WRITE_FAULTS_TRACE=str(tmp_path / "full.trace"), WRITE_FAULTS_DO="disk-full",
                      WRITE_FAULTS_MATCH=match, WRITE_FAULTS_NTH=str(nth))
    process = start(command, env, log)
    assert process.wait(timeout=300) == 1, log.read_text()[-3000:]

    lines = stderr_lines(log)
    if where == "checkpoint":
        assert lines[-3] == (f"[ddpo_group] error: no space left on device: {run}/checkpoints/.tmp_checkpoint_00001/"
                             "training_state.json (the training state) could not be written; checkpoint_00001 was not "
                             "saved (its unfinished files are removed)")
    else:
        assert lines[-3] == (f"[ddpo_group] error: no space left on device: {run}/metrics.jsonl (the metrics of "
                             "epoch 1) could not be written; the line is not added")
        assert [r["epoch"] for r in read_metrics(run / "metrics.jsonl")] == [0]
        assert (run / "metrics.jsonl").read_text().count("\n") == 1  # no half line left
    assert lines[-2].startswith(f"[ddpo_group] The last complete checkpoint, {run}/checkpoints/checkpoint_00000 "
                                "(epoch 0), is kept.")
    assert f"--config.resume_from={run}" in lines[-2]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["checkpoint_00000"]
    assert checkpoint_problem(run / "checkpoints" / "checkpoint_00000") is None

    resumed_log = tmp_path / "resumed.log"
    text = finish(start(train_command("ddpo", tiny_model_dir, tmp_path, "run", num_epochs=3, save_freq=1,
                                      reward_fn=WRITE_FAULTS, resume_from=run), environment(), resumed_log),
                  resumed_log)
    assert f"resumed from {run}/checkpoints/checkpoint_00000 (finished epoch 0)" in text
    assert [r["epoch"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]
    assert [p.name for p in complete_checkpoints(run / "checkpoints")][-1] == "checkpoint_00002"
