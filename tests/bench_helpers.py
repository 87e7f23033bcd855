"""Run a benchmark script as a user runs it: ``python bench/NAME.py ARGS`` from the repository root, in its own process
(one thread, no wandb, no hub: tests/launch_helpers.py's environment)."""

from __future__ import annotations

import subprocess
import sys

from launch_helpers import ROOT, launch_environment


def run_bench(script: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT.py ARGS``: its exit code, stdout and stderr (not checked)."""
    return subprocess.run([sys.executable, f"bench/{script}.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=launch_environment())


def succeeded(script: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT.py ARGS``, which must succeed: its output."""
    out = run_bench(script, *args, timeout=timeout)
    assert out.returncode == 0, f"bench/{script}.py exit {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def refused(script: str, *args) -> str:
    """``python bench/SCRIPT.py ARGS``, which must stop with an error (exit code 1 or argparse's 2): its stderr."""
    out = run_bench(script, *args)
    assert out.returncode in (1, 2), f"bench/{script}.py exit {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stderr
