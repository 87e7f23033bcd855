"""Shared by the model-based rewards: where weights come from, in which dtype, on which device.

* A *source* is a local directory/file or a Hugging Face hub id (``org/name``). A local-looking
  value that does not exist, or a hub id that cannot be loaded (offline, not cached, no such
  repository), raises an error naming the reward, the keyword argument and the value.
* ``dtype`` is a name: float32, bfloat16 or float16 (also fp32/bf16/fp16).
* ``device=None`` follows the images: the model moves to the device of the batch it scores, so
  a reward built before ``accelerate`` places the pipeline still runs where the images are.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import torch
from torch import nn

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype, reward: str) -> torch.dtype:
    """The torch dtype named by ``dtype`` (a torch.dtype passes through)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"{reward} reward: dtype={dtype!r} must be one of float32, bfloat16, float16") from None


def looks_local(source: str) -> bool:
    """True for values that can only be paths: absolute, relative with ./ ../ ~, or with more than one '/'.

    A hub id is ``name`` or ``org/name``; anything else is meant as a local path.
    """
    return source.startswith(("/", "./", "../", "~", "\\")) or source.count("/") > 1 or "\\" in source


def load_from_source(loader: Callable[[str], object], source, argument: str, reward: str, what: str):
    """``loader(source)`` for a local path or a hub id, with an error naming ``argument=source`` when it fails."""
    if not source:
        raise ValueError(f"{reward} reward needs reward_fn_kwargs.{argument}: {what}")
    source = str(source)
    path = Path(source).expanduser()
    local = path.exists()
    if not local and looks_local(source):
        raise FileNotFoundError(f"{reward} reward: {argument}={source!r} does not exist ({what})")
    try:
        return loader(str(path) if local else source)
    except (OSError, ValueError) as error:  # transformers: OSError for missing files and unknown / offline hub ids
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if local:
            raise OSError(f"{reward} reward: {argument}={source!r} could not be loaded as {what}: {first_line}") from error
        raise OSError(
            f"{reward} reward: {argument}={source!r} is neither an existing local path nor a hub id that could be "
            f"loaded ({first_line}). Give the local directory of {what}, or a hub id while online (or cached)."
        ) from error


def require_file(path, argument: str, reward: str, what: str) -> Path:
    """``path`` as a Path when it is an existing file; a clear error naming ``argument=path`` otherwise."""
    if not path:
        raise ValueError(f"{reward} reward needs reward_fn_kwargs.{argument}: the local path of {what}")
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{reward} reward: {argument}={str(path)!r} does not exist ({what})")
    return file


class DeviceFollower:
    """Moves ``module`` to the images' device (or the fixed ``device``) before each use; one batch at a time.

    The lock serialises calls from the trainer's reward threads, which share one model.
    """

    def __init__(self, module: nn.Module, device: str | None):
        self.module = module
        self.fixed = torch.device(device) if device else None
        self.lock = threading.Lock()

    def target(self, images: torch.Tensor) -> torch.device:
        return self.fixed or images.device

    def place(self, images: torch.Tensor) -> torch.device:
        """Move the module where it must run for ``images`` and return that device (call under ``lock``)."""
        device = self.target(images)
        current = next(self.module.parameters()).device
        if current != device:
            self.module.to(device)
        return device
