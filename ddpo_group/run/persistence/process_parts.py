"""Each process's part of a checkpoint: the files it writes itself, synced before the checkpoint is marked complete,
listed in the manifest, checked before a resume loads anything.

accelerate's ``save_state`` writes on every process: ``random_states_<i>.pkl`` (process i's random generators), and
under FSDP process i's shards of the weights and the optimizer (torch.distributed.checkpoint: ``__<i>_<n>.distcp`` in
``pytorch_model_fsdp_0/`` and ``optimizer_0/``; accelerate's per-process files ``*_rank<i>.bin`` without it). The main
process writes everything else. A checkpoint is complete only with the part of every process that wrote it: a process
that wrote elsewhere (another run directory, a disk another machine cannot see) leaves a checkpoint that does not
continue the run, so the save stops, naming the files, and a resume refuses such a checkpoint, naming the first file
missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddpo_group.run.persistence.manifest import MANIFEST

RANDOM_STATES = "random_states_{rank}.pkl"  # accelerate's name for process ``rank``'s random states
PART_PATTERNS = (RANDOM_STATES, "**/__{rank}_*.distcp", "*_rank{rank}.bin")


def sync(paths) -> None:
    """Flush ``paths`` (files, then the directories holding them) to the disk: written is not yet stored."""
    folders = set()
    for path in paths:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        folders.add(Path(path).parent)
    for folder in sorted(folders):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def process_part(directory: Path, rank: int) -> dict[str, int]:
    """{relative path: size} of the files process ``rank`` wrote into the checkpoint ``directory``, synced."""
    directory = Path(directory)
    found = {path for pattern in PART_PATTERNS for path in directory.glob(pattern.format(rank=rank)) if path.is_file()}
    sync(sorted(found))
    return {path.relative_to(directory).as_posix(): path.stat().st_size for path in sorted(found)}


def absent_parts(directory: Path, parts: list[dict[str, int]]) -> str | None:
    """None when ``directory`` holds every process's part as that process wrote it (``parts[i]``: process i's
    ``process_part``), else which files are not there."""
    absent = [f"process {rank}'s {name}" for rank, part in enumerate(parts) for name, size in part.items()
              if not (Path(directory) / name).is_file() or (Path(directory) / name).stat().st_size != size]
    empty = [f"process {rank} wrote no random states" for rank, part in enumerate(parts)
             if RANDOM_STATES.format(rank=rank) not in part]
    if not absent and not empty:
        return None
    return (f"{directory} does not hold every process's part: {'; '.join(absent + empty)} (each process writes its "
            "part into the run directory it names: every process must see the same one, on a filesystem every machine "
            "shares)")


def parts_record(parts: list[dict[str, int]]) -> dict:
    """What the manifest says of the processes: their count and each one's files."""
    return {"processes": len(parts), "parts": {str(rank): sorted(part) for rank, part in enumerate(parts)}}


def missing_part(checkpoint: Path, processes_fallback: int | None) -> str | None:
    """None when ``checkpoint`` holds the part of each process that wrote it, else the first file missing and whose it
    is. The manifest lists each process's files; a checkpoint whose manifest does not (``processes_fallback``: the
    process count its state_fields.json records, None: unknown) must hold each one's random states. A manifest that
    cannot be read passes here: the manifest's own check names it."""
    checkpoint = Path(checkpoint)
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        if "parts" in manifest:
            processes = int(manifest["processes"])
            parts = {int(rank): [str(name) for name in names] for rank, names in manifest["parts"].items()}
        else:  # written before the manifest listed the parts
            processes = processes_fallback or 1
            parts = {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    for rank in range(processes):
        for name in parts.get(rank) or [RANDOM_STATES.format(rank=rank)]:
            if not (checkpoint / name).is_file():
                return (f"{checkpoint / name} is missing: process {rank}'s part of a checkpoint written by {processes} "
                        "processes (a checkpoint is complete only with each one's files)")
    return None
