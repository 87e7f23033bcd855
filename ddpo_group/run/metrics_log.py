"""The run's local metrics log, ``<run_dir>/metrics.jsonl``: one JSON object per epoch, appended after it.

A SIGKILL can leave a half-written last line, and the epochs logged after the last checkpoint
are run again after a resume; :func:`rewind_metrics` drops both, so that the log matches the
checkpoint the run continues from and every epoch appears once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def append_metrics(path: str | os.PathLike, record: dict) -> None:
    """Append one epoch's metrics as a line (flushed: a later SIGKILL does not lose it)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


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
