"""A checkpoint's ``MANIFEST.json``: the name, size and sha256 of every other file in it, written last (with the
processes that wrote it and each one's files: run/persistence/process_parts.py).

A checkpoint whose files all match its manifest holds exactly what its save wrote; ``manifest_problem`` names the
first file that does not (missing, truncated, changed, or added after the save).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ddpo_group.run.persistence.write_errors import writing

MANIFEST = "MANIFEST.json"


def _files(directory: Path) -> list[str]:
    """Every file under ``directory`` but the manifest, as sorted relative POSIX paths."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, record: dict | None = None) -> None:
    """Record every file of ``directory`` (call it last: a file written after it fails the verification), and
    ``record``'s entries beside them (the processes and their parts: run/persistence/process_parts.py)."""
    directory = Path(directory)
    files = {name: {"size": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
             for name in _files(directory)}
    with writing(directory / MANIFEST, "the checkpoint's manifest"):
        (directory / MANIFEST).write_text(json.dumps({"files": files, **(record or {})}, indent=1) + "\n")


def manifest_problem(directory: Path) -> str | None:
    """None when every file of ``directory`` matches its manifest, else what is wrong with the first one that does
    not (sizes first, then contents)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        return f"{path} is missing (every save writes it last)"
    try:
        listed = json.loads(path.read_text())["files"]
        sizes = {str(name): int(entry["size"]) for name, entry in listed.items()}
        hashes = {str(name): str(entry["sha256"]) for name, entry in listed.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{path} is not a manifest ({type(error).__name__}: {error})"
    for name, size in sizes.items():
        file = directory / name
        if not file.is_file():
            return f"{file} is missing (listed in {MANIFEST})"
        actual = file.stat().st_size
        if actual != size:
            return f"{file} has {actual} bytes, {MANIFEST} says {size} (truncated or rewritten)"
    for name in _files(directory):
        if name not in sizes:
            return f"{directory / name} is not listed in {MANIFEST} (added after the save)"
    for name, digest in hashes.items():
        if _sha256(directory / name) != digest:
            return f"{directory / name} does not match its sha256 in {MANIFEST} (its contents changed after the save)"
    return None
