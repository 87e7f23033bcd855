"""An FSDP checkpoint's sharded state (torch.distributed.checkpoint, which unpickles its .metadata and its non-tensor
values) is read as plain data before anything loads it: a file that would build anything else stops the resume,
named, even when the manifest was rewritten to match."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator

from ddpo_group.errors import CheckpointError
from ddpo_group.run.persistence.checkpointing import TrainingState, resolve_resume_path, save_checkpoint
from ddpo_group.run.persistence.manifest import write_manifest
from ddpo_group.run.persistence.sharded_state import sharded_state_problem


class Payload:  # a class no checkpoint is made of: unpickling it would import and build what a file names
    def __reduce__(self):
        return os.getcwd, ()


class Setting:
    def __init__(self):
        self.value = 1


def save_sharded(directory, values: dict) -> None:
    """What accelerate's FSDP save writes: a model's tensors and an optimizer's settings, through DCP (one process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves without a process group
        dcp.save({"model": {"weight": torch.arange(6.0).reshape(2, 3)}, "param_groups": values},
                 storage_writer=dcp.FileSystemWriter(str(directory)))


def test_a_sharded_state_of_tensors_and_plain_values_passes(tmp_path):
    save_sharded(tmp_path / "optimizer_0", {"lr": 1e-4, "betas": (0.9, 0.999), "fused": None})
    assert (tmp_path / "optimizer_0" / ".metadata").is_file()
    assert sharded_state_problem(tmp_path) is None


def test_a_shard_the_metadata_names_and_that_is_missing_is_named_with_its_process(tmp_path):
    save_sharded(tmp_path / "optimizer_0", {"lr": 1e-4})
    (tmp_path / "optimizer_0" / "__0_0.distcp").unlink()
    assert sharded_state_problem(tmp_path) == (
        f"{tmp_path / 'optimizer_0' / '__0_0.distcp'} is missing: {tmp_path / 'optimizer_0' / '.metadata'} keeps "
        "'model.weight' in it, process 0's shard")


def test_metadata_that_builds_anything_else_is_refused_naming_the_file(tmp_path):
    save_sharded(tmp_path / "pytorch_model_fsdp_0", {"lr": 1e-4})
    (tmp_path / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Payload()))
    problem = sharded_state_problem(tmp_path)
    assert problem.startswith(f"{tmp_path / 'pytorch_model_fsdp_0' / '.metadata'} does not load as plain data")
    assert "getcwd is not part of a checkpoint's metadata" in problem


def test_a_value_that_is_not_plain_data_is_refused_naming_the_file_and_the_value(tmp_path):
    save_sharded(tmp_path / "optimizer_0", {"lr": 1e-4, "setting": Setting()})
    problem = sharded_state_problem(tmp_path)
    assert problem.startswith(f"{tmp_path / 'optimizer_0' / '__0_0.distcp'}: the value 'param_groups.setting' does "
                              "not load as plain data"), problem


def test_a_resume_stops_at_a_rewritten_sharded_state_even_with_a_matching_manifest(tmp_path):
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    state = TrainingState()
    state.epoch = 0
    checkpoint = save_checkpoint(accelerator, tmp_path / "run" / "checkpoints", 0, keep=2, pieces={"counters": state})
    save_sharded(checkpoint / "optimizer_0", {"lr": 1e-4})
    write_manifest(checkpoint)
    assert resolve_resume_path(str(checkpoint))[0] == checkpoint
    (checkpoint / "optimizer_0" / ".metadata").write_bytes(pickle.dumps(Payload()))
    write_manifest(checkpoint)  # whoever changed the file wrote the manifest again
    with pytest.raises(CheckpointError, match=r"optimizer_0/\.metadata does not load as plain data"):
        resolve_resume_path(str(checkpoint))
