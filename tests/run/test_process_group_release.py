"""run/process_failures: a run that stops with an error destroys its process group itself (an atexit-time destruction
can abort the process with exit -6 after its message), and a launched process then leaves at once with its exit code
and its output flushed, a finished one too; both are no-ops for a single process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import torch.distributed as dist

from ddpo_group.run.processes.process_failures import exit_launched_process, release_process_group
from helpers.launch_helpers import free_port


def test_release_destroys_the_default_group_and_is_a_no_op_after_it():
    assert release_process_group() is False  # no group: nothing to do, no error
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        assert release_process_group() is True
        assert not dist.is_initialized()
        assert release_process_group() is False
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_without_a_group_exit_launched_process_returns_and_the_exit_is_python_s(monkeypatch, capsys):
    """A single process (no group, no WORLD_SIZE > 1) returns: no os._exit, no message printed, no group made; the
    same call under a launcher's WORLD_SIZE=2 does leave, with the code (the spy sees it)."""
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not dist.is_initialized()
    assert exit_launched_process(SystemExit(3)) is None  # the caller re-raises
    assert exit_launched_process(SystemExit("a message")) is None
    assert exits == [] and capsys.readouterr().err == ""
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")
    exit_launched_process(SystemExit(3))
    assert exits == []
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launched process whose group is gone already: it leaves
    exit_launched_process(SystemExit(3))
    exit_launched_process(SystemExit("a message"))
    exit_launched_process(SystemExit(None))
    assert exits == [3, 1, 0]
    assert "a message" in capsys.readouterr().err
    assert not dist.is_initialized()


EXIT_SCRIPT = """
import sys, torch.distributed as dist
from ddpo_group.run.processes.process_failures import exit_launched_process
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
print("last words on stdout", end="")  # no newline: only a flush writes it
sys.stderr.write("[ddpo_group] error: the message")
exit_launched_process(SystemExit({code!r}))
print("not reached")
"""


FINISHED_SCRIPT = """
import sys
from ddpo_group.run.processes.process_failures import exit_launched_process
print("the run summary", end="")
exit_launched_process(SystemExit(0))
print("not reached")
sys.exit(3)
"""


@pytest.mark.parametrize("world_size, expected", [("2", "the run summary"), ("1", "the run summarynot reached\n")])
def test_a_finished_launched_process_leaves_at_once_after_its_group_is_gone(world_size, expected):
    """A finished run of several processes (the launcher's WORLD_SIZE > 1; Accelerator.end_training destroyed the
    group already) leaves with 0 before interpreter finalization; a single process returns."""
    done = subprocess.run([sys.executable, "-c", FINISHED_SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WORLD_SIZE": world_size})
    assert done.returncode == (0 if world_size == "2" else 3), done.stderr[-2000:]
    assert done.stdout == expected


@pytest.mark.parametrize("code, expected", [(130, 130), ("a message", 1)])
def test_a_launched_process_leaves_at_once_with_its_code_and_its_output(code, expected):
    script = EXIT_SCRIPT.format(port=free_port(), code=code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == expected, done.stderr[-2000:]
    assert done.stdout == "last words on stdout"
    assert done.stderr.startswith("[ddpo_group] error: the message")
    assert ("a message" in done.stderr) == (code == "a message")
