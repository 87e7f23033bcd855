"""The CPU thread count of a run (ddpo_group/run/processes/threads.py): accelerate launch's default of one thread is replaced by
the cores per process; a thread count the user gave (config, OMP_NUM_THREADS, the launcher's option) is kept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddpo_group.run.processes.threads import available_cores, choose_num_threads, launcher_chose_threads
from helpers.trainer_helpers import MECHANICS

ROOT = Path(__file__).resolve().parents[2]
LAUNCHED = {"OMP_NUM_THREADS": "1", "ACCELERATE_MIXED_PRECISION": "no"}  # what the child of accelerate launch sees
LAUNCHER_ARGV = ["python", "accelerate", "launch", "scripts/train.py"]


def test_only_the_launchers_own_default_counts_as_unchosen():
    assert launcher_chose_threads(LAUNCHED, LAUNCHER_ARGV, {"PATH": "/bin"})
    # the user set it: in the launcher's environment, or with the launcher's option (both spellings)
    assert not launcher_chose_threads(LAUNCHED, LAUNCHER_ARGV, {"OMP_NUM_THREADS": "1"})
    assert not launcher_chose_threads(LAUNCHED, LAUNCHER_ARGV[:3] + ["--num_cpu_threads_per_process", "1"], {})
    assert not launcher_chose_threads(LAUNCHED, LAUNCHER_ARGV[:3] + ["--num_cpu_threads_per_process=1"], {})
    # not launched by accelerate (python scripts/train.py with OMP_NUM_THREADS), or nothing set at all
    assert not launcher_chose_threads({"OMP_NUM_THREADS": "1"}, LAUNCHER_ARGV, {})
    assert not launcher_chose_threads({"ACCELERATE_MIXED_PRECISION": "no"}, LAUNCHER_ARGV, {})
    # the launcher process could not be read: keep the environment's setting
    assert not launcher_chose_threads(LAUNCHED, None, None)


def test_the_choice():
    # the config wins everywhere; the launcher's default is replaced by cores // processes on this machine
    assert choose_num_threads(3, on_cpu=False, launcher_default=True, cores=16, local_processes=2) == 3
    assert choose_num_threads(0, on_cpu=True, launcher_default=True, cores=16, local_processes=1) == 16
    assert choose_num_threads(0, on_cpu=True, launcher_default=True, cores=16, local_processes=3) == 5
    assert choose_num_threads(0, on_cpu=True, launcher_default=True, cores=2, local_processes=4) == 1
    # a GPU run, or a count the user chose: untouched
    assert choose_num_threads(0, on_cpu=False, launcher_default=True, cores=16, local_processes=1) is None
    assert choose_num_threads(0, on_cpu=True, launcher_default=False, cores=16, local_processes=1) is None


PROBE = textwrap.dedent("""
    import os, sys, torch
    from ddpo_group.run.processes.threads import apply_num_threads
    threads, why = apply_num_threads(int(sys.argv[1]), on_cpu=True, local_processes=1)
    print(f"RESULT {os.environ.get('OMP_NUM_THREADS')} {threads} {torch.get_num_threads()}")
""")


def launched(tmp_path, config_threads: int, launcher_options=(), **env_extra) -> tuple[str, int, int]:
    """Run the probe under the real accelerate launcher; returns (OMP_NUM_THREADS seen, chosen, torch's count)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update({"PYTHONPATH": str(ROOT), **env_extra})
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", *launcher_options, str(script), str(config_threads)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen, chosen, torch_threads = out.stdout.split("RESULT ")[1].split()
    return seen, int(chosen), int(torch_threads)


@pytest.mark.slow
def test_under_accelerate_launch_a_single_cpu_process_uses_the_cores_unless_told_otherwise(tmp_path):
    cores = available_cores()
    if cores < 2:
        pytest.skip("one core: the launcher's default is already every core")
    assert launched(tmp_path, 0) == ("1", cores, cores)  # the launcher set 1 on its own: replaced
    assert launched(tmp_path, 0, OMP_NUM_THREADS="1") == ("1", 1, 1)  # the user's environment: kept
    assert launched(tmp_path, 0, ["--num_cpu_threads_per_process", "1"]) == ("1", 1, 1)  # the user's option: kept
    assert launched(tmp_path, 3) == ("1", 3, 3)  # config.num_cpu_threads: set


@pytest.mark.slow
def test_the_trainer_applies_it_and_starts_quietly(tiny_model_dir, tmp_path):
    """A real run under accelerate launch with no thread setting reports (and uses) the cores of this machine."""
    cores = available_cores()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update({"WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})  # a CPU run anywhere
    values = {"pretrained.model": tiny_model_dir, "logdir": str(tmp_path), "run_name": "run", "num_epochs": 1,
              "prompt_fn": "simple_animals", "reward_fn": "jpeg_compressibility", "sample.num_steps": 2,
              "sample.batch_size": 4, "sample.num_batches_per_epoch": 1, "train.batch_size": 4,
              "per_prompt_stat_tracking.min_count": 2, "log_images_every": 0, **MECHANICS}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "scripts/train.py", "--config",
               "config/base.py:ddpo", *[f"--config.{k}={v}" for k, v in values.items()]]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"on 1 process(es) x {cores} CPU thread(s)" in out.stdout
    # and it is quiet (run/command/quiet.py): no torchvision fallback note, no weight-loading bar inside the pipeline's
    assert "requires torchvision" not in out.stderr and "Loading weights" not in out.stderr
    assert "Loading pipeline components" in out.stderr
