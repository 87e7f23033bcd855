"""How many CPU threads torch uses per process.

``accelerate launch`` without ``--num_cpu_threads_per_process`` or ``OMP_NUM_THREADS`` in the caller's environment
sets ``OMP_NUM_THREADS=1`` for its child (``accelerate/commands/launch.py``: ``get_int_from_env(["OMP_NUM_THREADS"],
1)``; only with ``--cpu`` and no OMP_NUM_THREADS does it count cores), so a single-process CPU run would use one
core. The trainer replaces that default, and only that default, by the cores available per process:

* ``config.num_cpu_threads > 0`` wins (on any device);
* otherwise, on a CPU run whose launcher set ``OMP_NUM_THREADS`` without being asked to, the physical cores this
  process may run on, divided among the processes of this machine (what accelerate itself chooses with ``--cpu``);
* otherwise the environment's setting stands (an explicit ``OMP_NUM_THREADS`` or launcher option, ``python
  scripts/train.py``).

Whether the launcher was asked is read from the launcher process itself (its command line and the environment it
was started with), through psutil, which accelerate depends on.
"""

from __future__ import annotations

import os

import torch

LAUNCHER_THREADS_OPTION = "--num_cpu_threads_per_process"


def available_cores() -> int:
    """Physical cores this process may run on: the CPU set (taskset, cgroups), capped at the physical cores."""
    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        logical = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or logical
    except ImportError:
        physical = logical
    return max(1, min(logical, physical))


def launcher_chose_threads(env: dict, launcher_argv: list[str] | None, launcher_env: dict | None) -> bool:
    """True when ``OMP_NUM_THREADS`` in ``env`` was set by accelerate's launcher on its own (its default of one
    thread), not by the user: the launcher ran (``ACCELERATE_MIXED_PRECISION`` is one of the variables every
    accelerate launcher sets) and neither its command line nor its own environment named a thread count.
    Unknown launcher details (``None``: the parent process could not be read) count as a user's choice."""
    if "OMP_NUM_THREADS" not in env or "ACCELERATE_MIXED_PRECISION" not in env:
        return False
    if launcher_argv is None or launcher_env is None:
        return False
    option = LAUNCHER_THREADS_OPTION
    asked = any(arg == option or arg.startswith(option + "=") for arg in launcher_argv)
    return not asked and "OMP_NUM_THREADS" not in launcher_env


def choose_num_threads(config_threads: int, on_cpu: bool, launcher_default: bool, cores: int,
                       local_processes: int) -> int | None:
    """The thread count to set, or None to keep the environment's (module docstring)."""
    if config_threads > 0:
        return config_threads
    if on_cpu and launcher_default:
        return max(1, cores // max(1, local_processes))
    return None


def _launcher() -> tuple[list[str] | None, dict | None]:
    """The parent process's command line and the environment it started with (None, None when unreadable)."""
    try:
        import psutil

        parent = psutil.Process(os.getppid())
        return parent.cmdline(), parent.environ()
    except Exception:  # psutil missing, AccessDenied, the parent gone: keep the environment's setting
        return None, None


def apply_num_threads(config_threads: int, on_cpu: bool, local_processes: int) -> tuple[int, str]:
    """Set torch's intra-op thread count as the module docstring says; returns (threads now, why)."""
    launcher_default = False
    if config_threads <= 0 and on_cpu:
        launcher_default = launcher_chose_threads(dict(os.environ), *_launcher())
    threads = choose_num_threads(config_threads, on_cpu, launcher_default, available_cores(), local_processes)
    if threads is None:
        return torch.get_num_threads(), "the environment's setting"
    torch.set_num_threads(threads)
    why = "config.num_cpu_threads" if config_threads > 0 else \
        f"cores per process (accelerate launch's default OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} replaced)"
    return threads, why
