"""A test reward that records the moments of a run and breaks one of them, so a test can SIGKILL a training process at
any of its moments, or fill its disk while it writes a chosen file.

``brightness``: the mean pixel value of each image. With ``WRITE_FAULTS_TRACE=<file>`` in the environment, ``make``
wraps, in this process (with ``WRITE_FAULTS_RANK=<i>``: only in the process of rank i of a launch), each moment a test
may stop at; each is an event, appended to the trace as a line ``<time> <number> <kind> <paths>`` before it happens:

=========================  ==================================================================
``reward``                 a reward call (sampling)
``step``                   an optimizer step, before it (training)
``metrics <path>``         a metrics line appended (metrics.jsonl, eval.jsonl)
``write <path>``           a file written: torch.save, safetensors' save_file, Path.write_text
``replace <src> <dst>``    a rename (os.replace)
``rmtree <path>``          a directory removed (shutil.rmtree)
=========================  ==================================================================

``WRITE_FAULTS_AT=<k>`` (the k-th event of this process, from 1) or ``WRITE_FAULTS_MATCH=<text>`` (the first event
whose line holds the text; the n-th with ``WRITE_FAULTS_NTH=<n>``) picks one event, and ``WRITE_FAULTS_DO`` what
happens there (its line in the trace ends with ``<- <action>``):

* ``kill``: SIGKILL before it;
* ``kill-mid``: the write done in part (the file cut to half its bytes, half a metrics line, one file of the directory
  removed), then SIGKILL; a reward call, a step or a rename: as ``kill``;
* ``disk-full``: the write fails as on a full disk: the file is opened on ``/dev/full``, so the kernel's ENOSPC
  reaches torch's or Python's own writer; a safetensors file: save_file raises what it raises on a full filesystem; a
  metrics line: half of it is written, then ENOSPC.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pathlib
import shutil
import signal
import threading
import time

from safetensors import SafetensorError

INSTALLED = {}
# what safetensors' save_file raises on a full filesystem (its own temporary file, renamed into place, cannot use
# /dev/full)
SAFETENSORS_DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


class Faults:
    def __init__(self, env):
        self.trace = env["WRITE_FAULTS_TRACE"]
        self.at = int(env.get("WRITE_FAULTS_AT", "0"))
        self.match = env.get("WRITE_FAULTS_MATCH", "")
        self.nth, self.matched = int(env.get("WRITE_FAULTS_NTH", "1")), 0
        self.action = env.get("WRITE_FAULTS_DO", "kill")
        self.count, self.fired = 0, False
        self.lock = threading.RLock()

    def event(self, kind: str, *paths) -> str | None:
        """Log the event; the action to take at it (None: none)."""
        with self.lock:
            self.count += 1
            line = " ".join([kind, *map(str, paths)])
            if self.match and self.match in line:
                self.matched += 1
            hit = not self.fired and (self.count == self.at or bool(self.match) and self.matched == self.nth)
            self.fired = self.fired or hit
            with open(self.trace, "a") as f:
                f.write(f"{time.time():.3f} {self.count} {line}{' <- ' + self.action if hit else ''}\n")
        if not hit:
            return None
        if self.action == "kill" or self.action == "kill-mid" and kind in ("reward", "step", "replace"):
            kill()
        return self.action


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


def cut_to_half(path: pathlib.Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def file_writer(faults: Faults, real, path_of):
    """``real`` (a function writing the file ``path_of(*args, **kwargs)``) with its event."""

    def write(*args, **kwargs):
        path = path_of(*args, **kwargs)
        if not isinstance(path, (str, os.PathLike)):  # a file object: not a file of the run
            return real(*args, **kwargs)
        path = pathlib.Path(path)
        action = faults.event("write", path)
        if action == "disk-full" and path.suffix == ".safetensors":  # its writer renames a temporary file into place
            raise SafetensorError(SAFETENSORS_DISK_FULL)
        if action == "disk-full":
            path.unlink(missing_ok=True)
            path.symlink_to("/dev/full")
        result = real(*args, **kwargs)
        if action == "kill-mid":
            cut_to_half(path)
            kill()
        return result

    return write


class HalfThenFull(io.FileIO):
    """A file on a disk that fills up: the first write takes half its bytes, the next fails with ENOSPC."""

    wrote = False

    def write(self, data):
        if self.wrote:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.wrote = True
        data = bytes(data)
        return super().write(data[: max(1, len(data) // 2)])


def install(faults: Faults) -> None:
    import accelerate.utils.other as accelerate_other
    import safetensors.torch
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from ddpo_group.run.persistence import metrics_log, state_files
    from ddpo_group.run.reporting import epoch_logger

    torch.save = file_writer(faults, torch.save, lambda obj, f, *a, **k: f)
    for module in (accelerate_other, state_files):  # their own names for safetensors' save_file
        module_name = "safe_save_file" if module is accelerate_other else "save_file"
        setattr(module, module_name, file_writer(faults, getattr(module, module_name),
                                                 lambda tensors, filename, *a, **k: filename))
    safetensors.torch.save_file = file_writer(faults, safetensors.torch.save_file,
                                              lambda tensors, filename, *a, **k: filename)
    pathlib.Path.write_text = file_writer(faults, pathlib.Path.write_text, lambda self, *a, **k: self)

    real_append = epoch_logger.append_metrics

    def append_metrics(path, record):
        action = faults.event("metrics", path)
        if action == "kill-mid":
            with open(path, "ab") as f:
                line = json.dumps(record).encode()
                f.write(line[: len(line) // 2])
            kill()
        if action == "disk-full":
            metrics_log.open = lambda file, mode, buffering=-1: HalfThenFull(file, mode.replace("b", ""))
            try:
                return real_append(path, record)
            finally:
                del metrics_log.open
        return real_append(path, record)

    epoch_logger.append_metrics = append_metrics

    real_replace = os.replace

    def replace(src, dst, **kwargs):
        faults.event("replace", src, dst)
        return real_replace(src, dst, **kwargs)

    os.replace = replace
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if os.path.isdir(path):
            if faults.event("rmtree", path) == "kill-mid":
                for file in sorted(pathlib.Path(path).rglob("*")):
                    if file.is_file():
                        file.unlink()
                        break
                kill()
        return real_rmtree(path, *args, **kwargs)

    shutil.rmtree = rmtree
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: faults.event("step"))


def make():
    rank = os.environ.get("WRITE_FAULTS_RANK")
    if "WRITE_FAULTS_TRACE" in os.environ and not INSTALLED and rank in (None, os.environ.get("RANK", "0")):
        INSTALLED["faults"] = Faults(os.environ)
        install(INSTALLED["faults"])
    faults = INSTALLED.get("faults")

    def brightness(images, prompts, metadata):
        if faults is not None:
            faults.event("reward")
        return images.double().mean(dim=(1, 2, 3)), {}

    return brightness
