"""Several processes on the default paths, and resumes on another process count (run/session.py, run/persistence/checkpointing.py,
run/persistence/process_parts.py, run/persistence/resume_check.py).

* One run directory: 2 gloo workers started 2 s apart (as on machines whose processes start seconds apart), on the
  default run name ``<preset>_<start second>``, which each would take from its own clock: one directory, and its
  checkpoint holds both processes' random states, listed per process in the manifest.
* A checkpoint without a process's part (its file removed; or, as a save that parted the processes' directories left
  it, a manifest that verifies without it) is refused, naming the file and the process.
* Another process count on purpose: the same run resumed on 1, then on 2 processes (DDP, LoRA; full fine-tuning
  2 -> 1 and FSDP 2 -> 4: tests/run/test_scale_out.py). Each resume says once what is not exact and continues from what
  is: each epoch is one optimizer step, and the checkpoint after it holds exactly one AdamW step from the checkpoint
  before (its weights and both moments, by torch's update formula), so the resumed run started from the saved weights
  and optimizer state; the training state goes on (the optimizer steps counted on, the same wandb run id).
* The launch a checkpoint was written under (FSDP or DDP, recorded, or for an older checkpoint read off its files) is
  checked before any model loads, and the warning of another process count says what continues and what does not.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from ddpo_group.errors import CheckpointError, ConfigError
from ddpo_group.run.persistence.checkpointing import resolve_resume_path
from ddpo_group.run.persistence.manifest import write_manifest
from ddpo_group.run.persistence.resume_check import STATE_FIELDS_FILE, check_resume, process_count_note, write_state_fields
from helpers.launch_helpers import launch_environment, start_workers
from helpers.resume_helpers import assert_continued_on_another_count, assert_every_process_part, read_metrics
from helpers.trainer_helpers import MECHANICS, tiny_config

TIMEOUT = 300
# one optimizer step an epoch (4 samples a process, one train batch of 4), on any process count
TINY = {
    "prompt_fn": "simple_animals", "reward_fn": "jpeg_compressibility", "sample.num_steps": 2, "sample.batch_size": 4,
    "sample.num_batches_per_epoch": 1, "train.batch_size": 4, "train.pairs_per_forward": 8,
    "train.learning_rate": 1e-2, "per_prompt_stat_tracking.min_count": 2, "save_freq": 1, "log_images_every": 0,
    "device": "cpu", **MECHANICS,
}


def args(preset: str, model_dir: str, logdir, num_epochs: int, **extra) -> list[str]:
    """No run_name: the default name. save_freq=1: a checkpoint after every epoch."""
    values = {**TINY, "pretrained.model": model_dir, "logdir": str(logdir), "num_epochs": num_epochs, **extra}
    return ["--config", f"config/base.py:{preset}", *[f"--config.{k}={v}" for k, v in values.items()]]


def finished(workers) -> str:
    """Every worker exited 0; their output together."""
    output = "".join(f"rank {w.rank}:\n{w.stdout}\n{w.stderr}\n" for w in workers)
    assert [w.returncode for w in workers] == [0] * len(workers), output[-6000:]
    return output


def assert_resumed_on_another_count(output: str, run, epoch: int, saved: int, now: int) -> None:
    """The resume of checkpoint ``epoch`` (written by ``saved`` processes) on ``now`` processes continued the run
    from it for one epoch, one optimizer step."""
    before, after = run / "checkpoints" / f"checkpoint_{epoch:05d}", run / "checkpoints" / f"checkpoint_{epoch + 1:05d}"
    assert_continued_on_another_count(output, before, after, saved, now)
    metrics = read_metrics(run)
    assert [m["epoch"] for m in metrics] == list(range(epoch + 2))  # each epoch once
    assert [m["global_step"] for m in metrics] == list(range(1, epoch + 3))  # one optimizer step an epoch


@pytest.mark.slow
def test_staggered_processes_share_one_run_directory_and_the_run_resumes_on_1_then_2_processes(tiny_model_dir,
                                                                                                tmp_path):
    logs = tmp_path / "logs"
    # 1. two workers 2 s apart on the default name: their clocks give two names, the run has one directory
    workers = start_workers(args("ddpo", tiny_model_dir, logs, 1), 2, tmp_path / "launch0", launch_environment(),
                            timeout=TIMEOUT, stagger_s=2.0)
    finished(workers)
    runs = sorted(logs.iterdir())
    assert len(runs) == 1 and re.fullmatch(r"ddpo_\d{8}_\d{6}", runs[0].name), runs
    run = runs[0]
    checkpoint = run / "checkpoints" / "checkpoint_00000"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint_00000"]  # nothing unfinished
    assert_every_process_part(checkpoint, 2)
    assert json.loads((checkpoint / "state_fields.json").read_text())["distributed"] == "DDP"

    # 2. a checkpoint without process 1's part is refused, naming it: the file removed (the manifest lists it), or a
    #    manifest that verifies without it (what processes that wrote to two directories left)
    for listed in (True, False):
        copy = tmp_path / f"copy_{listed}" / "checkpoints" / "checkpoint_00000"
        shutil.copytree(checkpoint, copy)
        (copy / "random_states_1.pkl").unlink()
        if not listed:
            write_manifest(copy)
        with pytest.raises(CheckpointError, match=re.escape(
                f"{copy / 'random_states_1.pkl'} is missing: process 1's part of a checkpoint written by 2 processes")):
            resolve_resume_path(str(copy))

    # 3. the run resumed on 1 process (2 -> 1), then on 2 (1 -> 2), one epoch each (2 -> 4: tests/run/test_scale_out.py)
    for epoch, (saved, now) in enumerate([(2, 1), (1, 2)]):
        workers = start_workers(args("ddpo", tiny_model_dir, logs, epoch + 2, resume_from=run), now,
                                tmp_path / f"launch{epoch + 1}", launch_environment(), timeout=TIMEOUT)
        output = finished(workers)
        assert_resumed_on_another_count(output, run, epoch, saved, now)
        print({f"{saved} -> {now} processes, rank {w.rank} seconds": round(w.seconds, 1) for w in workers})
    assert sorted(p.name for p in logs.iterdir()) == [run.name]


def test_the_launch_a_checkpoint_was_written_under_is_checked_and_another_process_count_warns(tiny_model_dir, tmp_path):
    config = tiny_config("ddpo", tiny_model_dir, tmp_path)
    write_state_fields(tmp_path, config, 2)  # a DDP checkpoint of 2 processes
    assert check_resume(tmp_path, config, 2) == []
    with pytest.raises(ConfigError, match=re.escape(f"resume_from='{tmp_path}' was written under DDP: its weights and "
                                                    "optimizer are whole (model.safetensors, optimizer.bin); this "
                                                    "launch shards them with FSDP")):
        check_resume(tmp_path, config, 2, sharded=True)
    # written before checkpoints recorded it: an FSDP checkpoint by its sharded model directory
    fields = json.loads((tmp_path / STATE_FIELDS_FILE).read_text())
    del fields["distributed"]
    (tmp_path / STATE_FIELDS_FILE).write_text(json.dumps(fields))
    (tmp_path / "pytorch_model_fsdp_0").mkdir()
    with pytest.raises(ConfigError, match="was written under FSDP: its weights and optimizer are sharded"):
        check_resume(tmp_path, config, 2)
    # another process count resumes, with one warning that says what continues exactly and what does not
    assert check_resume(tmp_path, config, 4, sharded=True) == [process_count_note(2, 4, True)]
    assert process_count_note(2, 4, True) == (
        "the checkpoint was written by 2 process(es), this run has 4: the weights and the optimizer state (resharded by "
        "torch.distributed.checkpoint) and every piece of the training state (the prompt sampler, the counters, the "
        "stat tracker, the controllers) continue exactly as saved; the run is not the exact continuation of a run on "
        "2: processes 2..3 start from the seed's random states (seed + process index), which the checkpoint does not "
        "hold, and each process samples another slice of an epoch's prompts")
    assert "(loaded by every process)" in process_count_note(1, 2, False)
    assert ": process 1 starts from the seed's random states" in process_count_note(1, 2, False)
    assert ": process 1's random states are not used" in process_count_note(2, 1, False)
    assert ": processes 1..2's random states are not used" in process_count_note(3, 1, False)
