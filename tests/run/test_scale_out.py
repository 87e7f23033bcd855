"""Scale-out runs on the CPU, each checkpointed after epoch 0, resumed for epoch 1 and compared with a run of both
epochs that was never stopped (the same weights, optimizer state, training state and metrics, bit for bit):

* FSDP2 full fine-tuning of the tiny SD3 (float32) and FLUX (bf16) transformers under the shipped ``fsdp_sd3.yaml`` /
  ``fsdp_flux.yaml``, 2 gloo processes (the files' GPU fields overridden: ``--num_processes 2`` and
  ``ACCELERATE_USE_CPU``, tests/helpers/launch_helpers.py); the checkpoint holds the sharded model and optimizer
  (torch.distributed.checkpoint, one file per process), not a gathered copy; one epoch gives DDP's weights; SD3's
  FSDP run resumes on 4 processes (resharded), its DDP run of full fine-tuning on 1, each one AdamW step on from its
  checkpoint, and a checkpoint resumed under the other kind (FSDP or DDP) is refused;
* 2 machines on one: two ``accelerate launch --config_file multi_node.yaml`` commands, machine ranks 0 and 1, one
  process each, meeting at 127.0.0.1 (LoRA on the tiny SD model).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddpo_group.errors import ConfigError
from ddpo_group.run.persistence.resume_check import check_resume
from helpers.launch_helpers import (ACCELERATE_CONFIGS, ROOT, accelerate_command, cpu_environment, free_port,
                                    launch_environment)
from helpers.resume_helpers import (assert_continued_on_another_count, assert_identical, comparable, load_everything,
                                    read_metrics)
from helpers.trainer_helpers import FAMILY_OVERRIDES, MECHANICS, tiny_config

TINY = {
    "prompt_fn": "simple_animals", "reward_fn": "jpeg_compressibility", "sample.num_steps": 2, "sample.batch_size": 4,
    "sample.num_batches_per_epoch": 1, "train.batch_size": 4, "train.group_size": 4, "train.pairs_per_forward": 8,
    "per_prompt_stat_tracking.min_count": 2, "save_freq": 1, "log_images_every": 0, "wandb.mode": "disabled",
    "device": "cpu", **MECHANICS,  # CPU kernels: two runs of one seed give the same bits
}
# full fine-tuning without a reference copy (docs/scaling.md: FSDP shards the policy only)
FULL = {"use_lora": False, "train.learning_rate": 1e-4, "kl.beta": 0.0, "kl.use_reference_model": False}
SHARDED = ("pytorch_model_fsdp_0", "optimizer_0")  # accelerate's DCP directories of the model and the optimizer


def train_args(model_dir: str, logdir: Path, run: str, num_epochs: int, **extra) -> list[str]:
    values = {**TINY, "pretrained.model": model_dir, "logdir": str(logdir), "run_name": run, "num_epochs": num_epochs,
              **extra}
    return ["scripts/train.py", "--config", "config/base.py:grpo", *[f"--config.{k}={v}" for k, v in values.items()]]


def start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def finish(processes: list[subprocess.Popen], log: Path, timeout: float = 600) -> str:
    for process in processes:
        process.wait(timeout=timeout)
    text = log.read_text()
    errors = "\n".join([line for line in text.splitlines() if "error" in line.lower() and "elastic" not in line][:20])
    assert all(p.returncode == 0 for p in processes), f"{[p.returncode for p in processes]}:\n{errors}\n{text[-3000:]}"
    return text


def fsdp_launch(config_name: str, args: list[str], log: Path) -> list[subprocess.Popen]:
    command, env = accelerate_command(2, ACCELERATE_CONFIGS / config_name)
    return [start(command + args, launch_environment(**env), log)]


def two_machines_launch(args: list[str], log: Path) -> list[subprocess.Popen]:
    """Machine 0 writes to ``log``, machine 1 beside it (``.machine1``)."""
    port = free_port()
    env = launch_environment(**cpu_environment(2))
    processes = []
    for rank in (0, 1):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ACCELERATE_CONFIGS / "multi_node.yaml"), "--num_machines", "2", "--num_processes", "2",
                   "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        processes.append(start(command + args, env, log if rank == 0 else log.with_suffix(".machine1")))
    return processes


def stopped_and_resumed_equals_uninterrupted(launch, model_dir: str, tmp_path: Path, **values) -> tuple[Path, Path]:
    """The run of epochs 0 and 1 (started alongside), and the run of epoch 0 then resumed for epoch 1; asserts they
    end identical. Returns their run directories."""
    reference = launch(train_args(model_dir, tmp_path, "reference", 2, **values), tmp_path / "reference.log")
    first = launch(train_args(model_dir, tmp_path, "resumed", 1, **values), tmp_path / "first.log")
    finish(first, tmp_path / "first.log")
    finish(reference, tmp_path / "reference.log")
    resumed_dir = tmp_path / "resumed"
    assert [p.name for p in sorted((resumed_dir / "checkpoints").glob("checkpoint_*"))] == ["checkpoint_00000"]

    log = tmp_path / "resume.log"
    text = finish(launch(train_args(model_dir, tmp_path, "resumed", 2, resume_from=resumed_dir, **values), log), log)
    assert f"resumed from {resumed_dir / 'checkpoints' / 'checkpoint_00000'} (finished epoch 0)" in text, text[-3000:]
    assert "for epochs 1..1 on 2 process(es)" in text, text[-3000:]

    final = "checkpoints/checkpoint_00001"
    expected, got = load_everything(tmp_path / "reference" / final), load_everything(resumed_dir / final)
    assert sorted(expected) == sorted(got)
    assert_identical(expected, got, "resumed")
    ref_metrics, resumed_metrics = read_metrics(tmp_path / "reference"), read_metrics(resumed_dir)
    assert [m["epoch"] for m in resumed_metrics] == [0, 1]  # each epoch once
    assert [comparable(m) for m in resumed_metrics] == [comparable(m) for m in ref_metrics]
    assert resumed_metrics[1]["global_step"] > resumed_metrics[0]["global_step"] > 0
    assert resumed_metrics[1]["reward_count"] == 8  # 4 images per process, gathered from both
    return tmp_path / "reference", resumed_dir


@pytest.mark.slow
@pytest.mark.parametrize("config_name, family, precision", [("fsdp_sd3.yaml", "sd3", "no"),
                                                             ("fsdp_flux.yaml", "flux", "bf16")])  # flow_grpo_flux's
def test_fsdp_full_fine_tuning_on_the_cpu_resumes_exactly(config_name, family, precision, family_model_dirs, tmp_path):
    launch = lambda args, log: fsdp_launch(config_name, args, log)  # noqa: E731
    reference, _ = stopped_and_resumed_equals_uninterrupted(launch, family_model_dirs[family], tmp_path, **FULL,
                                                            **FAMILY_OVERRIDES[family], mixed_precision=precision)
    checkpoint = reference / "checkpoints" / "checkpoint_00001"
    for name in SHARDED:  # sharded: one file per process, no gathered copy of the weights
        assert sorted(p.name for p in (checkpoint / name).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.bin").exists()  # DDP's
    # the transformer trained: every parameter is in the sharded model, and some moved in epoch 1
    before = load_everything(reference / "checkpoints" / "checkpoint_00000")["pytorch_model_fsdp_0"]["model"]
    after = load_everything(checkpoint)["pytorch_model_fsdp_0"]["model"]
    assert sorted(before) == sorted(after) and any(k.startswith("transformer_blocks.0.") for k in after)
    assert any(not torch.equal(before[k], after[k]) for k in after)


@pytest.mark.slow
@pytest.mark.parametrize("config_name, family", [("fsdp_sd3.yaml", "sd3"), ("fsdp_flux.yaml", "flux")])
def test_fsdp_on_the_cpu_trains_the_weights_ddp_trains(config_name, family, family_model_dirs, tmp_path):
    """The sharded forwards and backwards give DDP's update (within the order of the sums): FSDP's hooks gather every
    block's weights where they are used and reduce every gradient (torch warns that FLUX's single blocks return views,
    which an in-place op would let escape the backward's gather). SD3's runs then resume on another process count
    (``resumed_on_another_count``)."""
    model_dir = family_model_dirs[family]
    args = train_args(model_dir, tmp_path, "fsdp", 1, **FULL, **FAMILY_OVERRIDES[family])
    fsdp = fsdp_launch(config_name, args, tmp_path / "fsdp.log")
    command, env = accelerate_command(2, ACCELERATE_CONFIGS / "multi_gpu.yaml")
    args = train_args(model_dir, tmp_path, "ddp", 1, **FULL, **FAMILY_OVERRIDES[family])
    ddp = [start(command + args, launch_environment(**env), tmp_path / "ddp.log")]
    finish(fsdp, tmp_path / "fsdp.log")
    finish(ddp, tmp_path / "ddp.log")
    checkpoint = "checkpoints/checkpoint_00000"
    sharded = load_everything(tmp_path / "fsdp" / checkpoint)["pytorch_model_fsdp_0"]["model"]
    replicated = load_file(str(tmp_path / "ddp" / checkpoint / "model.safetensors"))
    initial = load_file(str(Path(model_dir) / "transformer" / "diffusion_pytorch_model.safetensors"))
    # DDP's checkpoint holds the trained weights (every parameter), without the buffers (SD3's position table)
    assert sorted(sharded) == sorted(initial) and set(replicated) == set(initial) - {"pos_embed.pos_embed"}
    moved = max((replicated[k] - initial[k]).abs().max().item() for k in replicated)
    apart = max((sharded[k] - replicated[k]).abs().max().item() for k in replicated)
    assert moved > 1e-5 and apart < 1e-6, (moved, apart)  # an Adam step of lr 1e-4; float32 sums in another order
    if family == "sd3":
        resumed_on_another_count(config_name, model_dir, tmp_path)


def resumed_on_another_count(config_name: str, model_dir: str, tmp_path: Path) -> None:
    """The FSDP run (2 processes) resumed on 4: torch.distributed.checkpoint reshards its weights and optimizer; the DDP
    run of full fine-tuning (2 processes) resumed on 1. Each continues one AdamW step from its checkpoint, with the
    note said once (tests/helpers/resume_helpers.py). A checkpoint resumed under the other kind is refused, naming
    it."""
    extra = {**FULL, **FAMILY_OVERRIDES["sd3"]}
    launches = {}  # run -> (processes, its launch, its log): both at once
    for run, processes, config_file in (("fsdp", 4, ACCELERATE_CONFIGS / config_name), ("ddp", 1, None)):
        command, env = accelerate_command(processes, config_file)
        log = tmp_path / f"{run}_on_{processes}.log"
        args = train_args(model_dir, tmp_path, run, 2, resume_from=tmp_path / run, **extra)
        launches[run] = (processes, [start(command + args, launch_environment(**env), log)], log)
    for run, (processes, launch, log) in launches.items():  # the FSDP run's 4 processes each hold a shard
        checkpoints = tmp_path / run / "checkpoints"
        assert_continued_on_another_count(finish(launch, log), checkpoints / "checkpoint_00000",
                                          checkpoints / "checkpoint_00001", 2, processes)

    # each checkpoint resumed under the other kind: refused before any model loads (the launch's kind, run/session.py)
    config = tiny_config("grpo", model_dir, tmp_path, **extra)
    with pytest.raises(ConfigError, match="was written under FSDP: its weights and optimizer are sharded"):
        check_resume(tmp_path / "fsdp" / "checkpoints" / "checkpoint_00001", config, 1, sharded=False)
    with pytest.raises(ConfigError, match="was written under DDP: its weights and optimizer are whole"):
        check_resume(tmp_path / "ddp" / "checkpoints" / "checkpoint_00001", config, 2, sharded=True)


@pytest.mark.slow
def test_two_machines_on_one_train_checkpoint_and_resume_exactly(tiny_model_dir, tmp_path):
    reference, resumed = stopped_and_resumed_equals_uninterrupted(two_machines_launch, tiny_model_dir, tmp_path)
    machine1 = (tmp_path / "resume.machine1").read_text()
    # machine 1's process is the main process of its machine (its progress bars) but not of the run (no messages)
    assert "epoch 1: sampling" in machine1 and "[ddpo_group]" not in machine1, machine1[-3000:]
    for run in (reference, resumed):  # each process of each machine saved its random states into the one checkpoint
        checkpoint = run / "checkpoints" / "checkpoint_00001"
        assert sorted(p.name for p in checkpoint.glob("random_states_*.pkl")) == ["random_states_0.pkl",
                                                                                    "random_states_1.pkl"]
