"""Start scripts/train.py as several processes, the way a test needs: through ``accelerate launch`` (its command line,
with a config file of config/accelerate/ or without), or as workers started one by one (``start_workers``: what
torchrun does on each machine of a multi-node run, without a launcher that kills the others when one fails).

More processes than visible GPUs run on the CPU over gloo: with one GPU, 2 processes asking for NCCL would fail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = ROOT / "config" / "accelerate"


def needs_cpu(num_processes: int) -> bool:
    """True when ``num_processes`` processes cannot each have a GPU of their own here (they run on the CPU, gloo)."""
    return torch.cuda.device_count() < num_processes


def cpu_environment(num_processes: int) -> dict:
    """The environment additions of ``num_processes`` processes: none when each has a GPU; else the CPU for all
    (``ACCELERATE_USE_CPU``) with the GPUs hidden, as on a machine without any (a CPU process would otherwise open a
    CUDA context in accelerate's checkpoint, which saves every GPU's random state: on a GPU shared with other work
    that can fail on one process and leave the other at the checkpoint's barrier)."""
    return {"ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": ""} if needs_cpu(num_processes) else {}


def accelerate_command(num_processes: int = 1, config_file: str | Path | None = None) -> tuple[list[str], dict]:
    """(``python -m accelerate.commands.launch ...`` up to the script's path, environment additions) for
    ``num_processes`` processes.

    Without ``config_file``: one process, or ``--multi_gpu`` for several; ``--num_processes`` wins over a config file's.
    With fewer GPUs than processes, the processes run on the CPU through ``ACCELERATE_USE_CPU=true`` in their
    environment, not through ``--cpu``: accelerate launch --cpu starts one process only (its simple launcher, unless
    mpirun), while the multi-GPU launcher (torchrun) starts them all and passes the variable on."""
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file is not None:
        command += ["--config_file", str(config_file)]
    elif num_processes > 1:
        command += ["--multi_gpu"]
    command += ["--num_processes", str(num_processes)]
    if config_file is None:
        command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if num_processes > 1:  # a port of its own: tests running side by side (pytest-xdist) never meet at 29500
        command += ["--main_process_port", str(free_port())]
    env = cpu_environment(num_processes) if num_processes > 1 else {}
    return command, env


def launch_environment(**extra) -> dict:
    """No wandb, no hub, one thread per process (the 2-core test machine is shared), no test plugin switches left on."""
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for name in ("DDPO_GROUP_TRACEBACK", "FAIL_REWARD_AT", "FAIL_REWARD_RANK", "FAIL_REWARD_MODE",
                 "NAN_LOSS_FROM_CALL", "NAN_LOSS_RANK", "HANG_REWARD_AT"):
        env.pop(name, None)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One started worker process: its rank, exit code, output and the seconds from its start to its exit."""

    def __init__(self, rank: int, process: subprocess.Popen, logs: Path):
        self.rank, self.process, self.logs = rank, process, logs
        self.started, self.seconds = time.perf_counter(), None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def stdout(self) -> str:
        return (self.logs / f"rank{self.rank}.out").read_text()

    @property
    def stderr(self) -> str:
        return (self.logs / f"rank{self.rank}.err").read_text()


def start_workers(args: list[str], num_processes: int, logs: Path, env: dict | None = None,
                  timeout: float = 300, grace_after_first_exit: float | None = None,
                  stagger_s: float = 0.0, script: str = "scripts/train.py") -> list[Worker]:
    """Run ``script args`` (scripts/train.py) as ``num_processes`` workers of one process group (env:// rendezvous, as
    torchrun sets it up on each machine) and wait for all; their output goes to ``logs``/rank<i>.out / .err. A worker
    still running after ``timeout`` seconds is killed (returncode -9), or ``grace_after_first_exit`` seconds after the
    first worker exited (what torchrun does to the workers of a failed one). ``stagger_s``: the seconds between two
    workers' starts (machines whose processes start apart)."""
    env = env or launch_environment()
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    workers = []
    for rank in range(num_processes):
        if rank and stagger_s:
            time.sleep(stagger_s)
        worker_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_processes),
                      "LOCAL_WORLD_SIZE": str(num_processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        worker_env.update(cpu_environment(num_processes))
        with open(logs / f"rank{rank}.out", "w") as out, open(logs / f"rank{rank}.err", "w") as err:
            process = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=worker_env,
                                       stdout=out, stderr=err, text=True)
        workers.append(Worker(rank, process, logs))
    deadline = time.perf_counter() + timeout
    while any(w.seconds is None for w in workers):
        for worker in workers:
            if worker.seconds is None and worker.process.poll() is not None:
                worker.seconds = time.perf_counter() - worker.started
        ended = [w.started + w.seconds for w in workers if w.seconds is not None]
        if ended and grace_after_first_exit is not None:
            deadline = min(deadline, min(ended) + grace_after_first_exit)
        if time.perf_counter() > deadline:
            for worker in workers:
                if worker.seconds is None:
                    worker.process.kill()
                    worker.process.wait()
                    worker.seconds = time.perf_counter() - worker.started
        time.sleep(0.1)
    return workers
