"""What tests of resume compare: a run's logged metrics and every file of its checkpoints, loaded; one AdamW step
between two checkpoints (a resume on another process count); each process's part of a checkpoint."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import load
from safetensors.torch import load_file

from ddpo_group.run.persistence.checkpointing import checkpoint_problem
from ddpo_group.run.persistence.manifest import MANIFEST
from ddpo_group.run.persistence.state_files import STATE_JSON, read_states


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


def weights_and_optimizer(checkpoint) -> tuple[dict, dict, dict]:
    """(the trained weights by name, the optimizer's per-weight states by its keys, its hyperparameters): DDP's
    model.safetensors and optimizer.bin (states by position), or FSDP's sharded directories joined (by name)."""
    if (checkpoint / "model.safetensors").exists():
        weights, optimizer = load_file(str(checkpoint / "model.safetensors")), load(checkpoint / "optimizer.bin")
    else:
        weights = load_sharded(checkpoint / "pytorch_model_fsdp_0")["model"]
        optimizer = load_sharded(checkpoint / "optimizer_0")["optimizer"]
    return weights, optimizer["state"], optimizer["param_groups"][0]


def one_each(candidates: dict) -> dict | None:
    """{name: key}, a different name for each key among its ``candidates[key]`` (augmenting paths), or None."""
    owner: dict = {}

    def take(key, seen: set) -> bool:
        for name in candidates[key]:
            if name not in seen:
                seen.add(name)
                if name not in owner or take(owner[name], seen):
                    owner[name] = key
                    return True
        return False

    return owner if all(take(key, set()) for key in candidates) else None


def assert_one_adamw_step(before, after) -> None:
    """Checkpoint ``after``'s weights and Adam moments are one step of torch's AdamW from ``before``'s: with the
    gradient g = (m' - b1 m) / (1 - b1) the first moment implies, the second is v' = b2 v + (1 - b2) g^2 and every
    weight the optimizer holds is w' = w (1 - lr wd) - lr / (1 - b1^t) m' / (sqrt(v' / (1 - b2^t)) + eps); every other
    weight is unchanged. A resume that started from fresh weights or a fresh optimizer misses each by far more than the
    float32 rounding allowed here."""
    w, states, _ = weights_and_optimizer(before)
    w_next, states_next, group = weights_and_optimizer(after)
    lr, (b1, b2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    assert sorted(w) == sorted(w_next) and sorted(states) == sorted(states_next) and states
    steps = {}  # optimizer key -> the step of its weight
    for key, state in states_next.items():
        m, v, m_next, v_next = (states[key]["exp_avg"], states[key]["exp_avg_sq"], state["exp_avg"],
                                state["exp_avg_sq"])
        t = float(state["step"])
        assert t == float(states[key]["step"]) + 1
        g = (m_next - b1 * m) / (1 - b1)
        torch.testing.assert_close(v_next, b2 * v + (1 - b2) * g * g, rtol=1e-3, atol=1e-3 * float(v_next.max()))
        steps[key] = lr / (1 - b1**t) * m_next / (v_next.sqrt() / math.sqrt(1 - b2**t) + eps)

    def one_step(name, key):
        return w[name] * (1 - lr * decay) - steps[key]

    # DDP's states are by position: each is the step of one weight (weights alike, e.g. biases that started at zero
    # with the same gradients' signs, may take each other's)
    candidates = {key: [key] if key in w else [n for n in w if w[n].shape == step.shape and torch.allclose(
        w_next[n], one_step(n, key), rtol=0, atol=1e-6)] for key, step in steps.items()}
    matched = one_each(candidates)
    assert matched is not None, {key: names for key, names in candidates.items() if len(names) != 1}
    for name, key in matched.items():
        torch.testing.assert_close(w_next[name], one_step(name, key), rtol=0, atol=1e-6)
    for name in set(w) - set(matched):  # the adapters the optimizer does not train
        assert torch.equal(w[name], w_next[name]), name


def assert_every_process_part(checkpoint, processes: int) -> None:
    """The manifest of ``checkpoint`` lists the part of each of its ``processes``: its random states and, under FSDP,
    its shard of the weights and of the optimizer; each is there, and the checkpoint verifies."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert manifest["processes"] == processes
    sharded = [d for d in ("pytorch_model_fsdp_0", "optimizer_0") if (checkpoint / d).is_dir()]
    for rank in range(processes):
        part = [f"random_states_{rank}.pkl", *[f"{d}/__{rank}_0.distcp" for d in sharded]]
        assert sorted(manifest["parts"][str(rank)]) == sorted(part) and all((checkpoint / f).is_file() for f in part)
    assert not (checkpoint / f"random_states_{processes}.pkl").exists()
    assert checkpoint_problem(checkpoint) is None


def training_state(checkpoint: Path) -> dict:
    return dict(read_states(checkpoint))["counters"]


def assert_continued_on_another_count(output: str, before: Path, after: Path, saved: int, now: int) -> None:
    """A run resumed from checkpoint ``before`` (written by ``saved`` processes) on ``now`` processes said so once (the
    launch's ``output``: every process's) and continued from it to checkpoint ``after``, one optimizer step later: its
    weights and optimizer (one AdamW step), its training state (the step counter on by one, the same wandb run id),
    each process's part."""
    assert f"resumed from {before} (finished epoch " in output, output[-3000:]
    note = f"the checkpoint was written by {saved} process(es), this run has {now}: the weights and the optimizer state"
    assert output.count(note) == 1, output[-3000:]  # said once, by the main process
    assert "continue exactly as saved; the run is not the exact continuation" in output
    assert training_state(after)["global_step"] == training_state(before)["global_step"] + 1
    assert training_state(after)["wandb_run_id"] == training_state(before)["wandb_run_id"]
    assert_one_adamw_step(before, after)
    assert_every_process_part(after, now)
