"""The run's local metrics log, ``<run_dir>/metrics.jsonl``: one JSON object per epoch, appended after it.

A SIGKILL can leave a half-written last line (reading skips it, the next line starts a line of its own), and the
epochs logged after the last checkpoint are run again after a resume; :func:`rewind_metrics` drops both, so that the
log matches the checkpoint the run continues from and every epoch appears once. A full disk leaves the log as it was.
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path

from ddpo_group.run.persistence.write_errors import WriteError, describe_write_error


def append_metrics(path: str | os.PathLike, record: dict) -> None:
    """Append one epoch's metrics as a line, written through at once (a later SIGKILL does not lose it). A line cut
    by a kill is ended first, so the record is a line of its own. A write that fails (a full disk) takes back what
    it wrote and raises a WriteError naming the file."""
    path = Path(path)
    line = (json.dumps(record) + "\n").encode()
    with open(path, "a+b", buffering=0) as f:  # unbuffered: each write reaches the file or fails here
        start = f.seek(0, os.SEEK_END)
        if start:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                line = b"\n" + line
        try:
            rest = memoryview(line)
            while rest:  # a write may take part of the line
                rest = rest[f.write(rest):]
        except OSError as error:
            with suppress(OSError):
                f.truncate(start)
            what = f"the metrics of epoch {record.get('epoch')}"
            raise WriteError(f"{describe_write_error(error, path, what)}; the line is not added") from error


def read_metric_lines(path: str | os.PathLike) -> list[dict]:
    """Every complete record of the log in file order; a line that is not valid JSON (cut by a kill) is skipped."""
    path = Path(path)
    return _records(path.read_text().splitlines()) if path.exists() else []


def _records(lines: list[str]) -> list[dict]:
    records = []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def rewind_metrics(path: str | os.PathLike, last_epoch: int) -> int:
    """Keep the records of epochs <= ``last_epoch`` (the checkpoint's), rewritten atomically; return how many were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = [r for r in _records(lines) if int(r.get("epoch", -1)) <= last_epoch]
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
    return dropped


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The epochs of a metrics.jsonl (one JSON object a line); a later line for an epoch replaces an earlier one."""
    by_epoch = {}
    for record in read_metric_lines(path):  # a line cut by a kill is skipped
        by_epoch[record.get("epoch", len(by_epoch))] = record
    return [by_epoch[k] for k in sorted(by_epoch)]
