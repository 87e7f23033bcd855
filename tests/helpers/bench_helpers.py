"""Run a benchmark script as a user runs it, ``python bench/NAME.py ARGS`` from the repository root: in this process
(``runpy`` runs the file as ``__main__`` with that command line, bench/ first on the path as Python puts a script's
folder, the root the working directory, and launch_helpers.py's environment: one thread, no wandb, no hub), or with
``process=True`` in a process of its own (the file started by Python, as test_compare_algorithms_runs does once).
A run in this process saves the 6 s of imports a fresh Python spends; what it changes of this process (the environment,
the command line, the path, the working directory, torch's thread count, the libraries' log levels) is put back when it
ends."""

from __future__ import annotations

import io
import os
import runpy
import subprocess
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout

import torch

from helpers.launch_helpers import ROOT, launch_environment


def exit_code(stop: SystemExit) -> int:
    """The exit status Python gives ``raise SystemExit(code)`` (a message: printed, status 1)."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def run_in_this_process(script: str, args: list[str]) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT.py ARGS`` through runpy: its exit status, stdout and stderr (a traceback as Python prints
    one for an exception that ends a script)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    path = ROOT / "bench" / f"{script}.py"
    saved = (dict(os.environ), list(sys.argv), list(sys.path), os.getcwd(), torch.get_num_threads(),
             diffusers_logging.get_verbosity(), transformers_logging.get_verbosity())
    out, err = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(launch_environment())
    sys.argv, sys.path[:0] = [str(path), *args], [str(path.parent)]
    os.chdir(ROOT)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                runpy.run_path(str(path), run_name="__main__")
                code = 0
            except SystemExit as stop:
                code = exit_code(stop)
            except Exception:  # a script's uncaught error, as Python reports it (Ctrl-C still stops the tests)
                traceback.print_exc()
                code = 1
    finally:
        environ, sys.argv, sys.path[:], cwd, threads, diffusers_level, transformers_level = saved
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        diffusers_logging.set_verbosity(diffusers_level)
        transformers_logging.set_verbosity(transformers_level)
    return subprocess.CompletedProcess([sys.executable, str(path), *args], code, out.getvalue(), err.getvalue())


def run_bench(script: str, *args, process: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT.py ARGS``: its exit code, stdout and stderr (not checked); ``timeout`` for a process."""
    args = list(map(str, args))
    if not process:
        return run_in_this_process(script, args)
    return subprocess.run([sys.executable, f"bench/{script}.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=launch_environment())


def succeeded(script: str, *args, process: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT.py ARGS``, which must succeed: its output."""
    out = run_bench(script, *args, process=process, timeout=timeout)
    assert out.returncode == 0, f"bench/{script}.py exit {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def refused(script: str, *args) -> str:
    """``python bench/SCRIPT.py ARGS``, which must stop with an error (exit code 1 or argparse's 2): its stderr."""
    out = run_bench(script, *args)
    assert out.returncode in (1, 2), f"bench/{script}.py exit {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stderr
