"""What tests of exact resume compare: a run's logged metrics and every file of its checkpoints, loaded."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import load
from safetensors.torch import load_file

from ddpo_group.run.state_files import STATE_JSON, read_states


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def load_sharded(directory: Path) -> dict:
    """A torch.distributed.checkpoint directory (an FSDP checkpoint's sharded model or optimizer), every process's
    shards joined into whole tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(directory, whole)
        return torch.load(whole, weights_only=True)


def load_everything(checkpoint: Path) -> dict:
    """Every file of a checkpoint, loaded: safetensors as tensors, the training state's pieces, accelerate's .bin/.pkl
    with weights_only=True, FSDP's sharded directories joined (MANIFEST.json differs by the wandb run id in the
    training state, compared apart; a sharded directory's .metadata by its save id)."""
    out = {}
    for path in sorted(checkpoint.rglob("*")):
        name = str(path.relative_to(checkpoint))
        if path.name == STATE_JSON:
            out[name] = read_states(checkpoint)
        elif path.suffix == ".safetensors":
            out[name] = load_file(str(path))
        elif path.suffix in (".bin", ".pkl"):
            out[name] = load(path)  # accelerate's loader: weights_only=True
        elif path.is_dir() and (path / ".metadata").is_file():
            out[name] = load_sharded(path)
    return out


def assert_identical(a, b, where: str = "") -> None:
    """Bitwise equality of nested checkpoint contents (tensors, arrays, containers, numbers; NaN equals NaN)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            if key != "wandb_run_id":  # a fresh id per run, by design; compared separately
                assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), where
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "perf/"))}  # wall-clock timings differ
