"""A file of the run that cannot be written: one error that names the file and what it holds, and says so plainly
when the disk is full.

A full disk reaches Python in several forms: an OSError with ENOSPC (or EDQUOT, a quota) from Python's own writes, an
error whose text says "No space left on device" (safetensors), or a RuntimeError that keeps no errno (torch.save:
"[enforce fail at inline_container.cc:672] . unexpected pos ..."); for the last, the free space left on the file's
filesystem tells.
"""

from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXTS = ("no space left on device", "disk quota exceeded")
NEARLY_FULL_BYTES = 1 << 20  # less free space than this after a failed write: the disk filled up


class WriteError(OSError):
    """A file of the run could not be written; the message names it, what it holds, and the cause."""


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _free_bytes(path: Path) -> int | None:
    for folder in (path, *path.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:  # not there (yet, or any more): its parent's filesystem
            continue
    return None


def disk_full(error: BaseException, path: Path) -> bool:
    """True when ``error``, raised while writing ``path``, comes from a full disk (or an exceeded quota)."""
    for cause in _chain(error):
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(cause).lower() for text in DISK_FULL_TEXTS):
            return True
    free = _free_bytes(Path(path))
    return free is not None and free < NEARLY_FULL_BYTES


def describe_write_error(error: BaseException, path: Path, what: str) -> str:
    """"no space left on device: <path> (<what>) could not be written", or the same with the error's first line."""
    if disk_full(error, path):
        return f"no space left on device: {path} ({what}) could not be written"
    text = str(error).strip().splitlines()
    return f"{path} ({what}) could not be written: {type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


@contextmanager
def writing(path: str | Path, what: str):
    """Turn any error of the writes inside into a WriteError naming ``path`` and ``what`` (an inner WriteError,
    which already names its file, passes unchanged)."""
    try:
        yield
    except WriteError:
        raise
    except Exception as error:
        raise WriteError(describe_write_error(error, Path(path), what)) from error
