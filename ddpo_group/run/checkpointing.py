"""Checkpoints through accelerate's save_state/load_state, written to a temporary directory then renamed.

Layout: ``<run_dir>/checkpoints/checkpoint_<epoch:05d>/``; a directory is complete once it holds
``COMPLETE`` (written last, before the rename), and only complete ones are resumed from or kept.
A crash at any point of a save leaves every complete checkpoint written before it, and at worst
a hidden ``.tmp_*`` / ``.replaced_*`` / ``.deleting_*`` directory that the next save clears up.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable

CHECKPOINT_PATTERN = re.compile(r"^checkpoint_(\d+)$")
COMPLETE_MARKER = "COMPLETE"


class TrainingState:
    """Epoch and optimizer-step counters and the wandb run id, saved with every checkpoint."""

    def __init__(self):
        self.epoch = -1  # last finished epoch
        self.global_step = 0
        self.wandb_run_id = ""  # set at the first start; a resumed run logs to the same wandb run
        self.sizes = {}  # what "auto" settings resolved to (update/memory_fit.py): a resumed run keeps them

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "global_step": self.global_step, "wandb_run_id": self.wandb_run_id,
                "sizes": dict(self.sizes)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.wandb_run_id = str(state.get("wandb_run_id", ""))  # older checkpoints have none
        self.sizes.clear()  # in place: the chunk-size resolver holds this dict
        self.sizes.update(state.get("sizes", {}))


def complete_checkpoints(checkpoint_root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories under ``checkpoint_root``, oldest first."""
    root = Path(checkpoint_root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = CHECKPOINT_PATTERN.match(path.name)
        if match and (path / COMPLETE_MARKER).exists():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_resume_path(resume_from: str) -> Path:
    """A checkpoint directory, or a run directory whose latest complete checkpoint is taken."""
    path = Path(resume_from).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"resume_from={resume_from!r} does not exist")
    if (path / COMPLETE_MARKER).exists():
        return path
    for root in (path / "checkpoints", path):
        checkpoints = complete_checkpoints(root)
        if checkpoints:
            return checkpoints[-1]
    raise FileNotFoundError(
        f"resume_from={resume_from!r} is neither a complete checkpoint nor a run directory holding one "
        f"(looked for checkpoints/checkpoint_<epoch>/{COMPLETE_MARKER})"
    )


def run_dir_of_checkpoint(checkpoint: Path) -> Path:
    return checkpoint.parent.parent


def later_checkpoints(checkpoint: Path) -> list[Path]:
    """Complete checkpoints beside ``checkpoint`` of later epochs (a resume from an older one abandons them)."""
    siblings = complete_checkpoints(checkpoint.parent)
    names = [p.name for p in siblings]
    return siblings[names.index(checkpoint.name) + 1 :] if checkpoint.name in names else []


def clear_leftovers(root: Path) -> None:
    """Remove what an interrupted save left in ``root``; a complete checkpoint moved aside to be replaced by a
    new save of its epoch goes back into place if that save never finished."""
    for replaced in root.glob(".replaced_checkpoint_*"):
        original = root / replaced.name[len(".replaced_"):]
        if (replaced / COMPLETE_MARKER).exists() and not (original / COMPLETE_MARKER).exists():
            shutil.rmtree(original, ignore_errors=True)
            os.replace(replaced, original)
    for pattern in (".tmp_checkpoint_*", ".replaced_checkpoint_*", ".deleting_checkpoint_*"):
        for leftover in root.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def checkpoint_dir(checkpoint_root: str | os.PathLike, epoch: int) -> Path:
    """Where the checkpoint of finished epoch ``epoch`` lives (complete once it holds COMPLETE)."""
    return Path(checkpoint_root) / f"checkpoint_{epoch:05d}"


def save_checkpoint(
    accelerator, checkpoint_root: str | os.PathLike, epoch: int, keep: int, extra: Callable[[Path], None] | None = None
) -> Path:
    """Save the accelerate state for ``epoch`` atomically; keep the newest ``keep`` complete checkpoints.

    ``extra(directory)`` (main process) adds files to the checkpoint before it is marked complete
    (e.g. the diffusers-format LoRA in ``lora/``).
    """
    root = Path(checkpoint_root)
    final = checkpoint_dir(root, epoch)
    tmp = root / f".tmp_{final.name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        clear_leftovers(root)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if extra is not None:
            extra(tmp)
        (tmp / COMPLETE_MARKER).write_text(f"epoch {epoch}\n")
        if final.exists():  # the same epoch saved again: move the old one aside, never leave neither
            stale = root / f".replaced_{final.name}"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(tmp, final)
        # rotation: the newest ``keep`` by epoch, and never the checkpoint just written; each is renamed out of
        # the checkpoint pattern first, so a crash while deleting never leaves a half-deleted "complete" one
        for old in complete_checkpoints(root)[:-keep]:
            if old != final:
                doomed = root / f".deleting_{old.name}"
                shutil.rmtree(doomed, ignore_errors=True)
                os.replace(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
