"""The training state's pieces as two files of a checkpoint: their tensors in ``training_state.safetensors``, all else
in ``training_state.json``. Nothing is pickled, so loading a checkpoint runs no code it holds.

The pieces are what the trainer names (the prompt sampler, the counters, the stat tracker, and the state of each of the
run's components: run/components.py), each saved as its ``state_dict()`` under its name: a tree
of dicts, lists, tuples, strings, numbers, booleans, None and tensors. In the JSON every container is an object with
one key that says what it was, so the tree loads back as it was saved (a tuple stays a tuple, an optimizer state's int
keys stay ints, NaN stays NaN):

=====================================  ====================================================
``{"dict": {key: value, ...}}``        a dict whose keys are all strings
``{"items": [[key, value], ...]}``     any other dict (keys are numbers or strings)
``{"tuple": [...]}``, a JSON list      a tuple, a list
``{"tensor": "<key>"}``                a tensor, stored under ``<key>`` in the safetensors
``{"float": "nan" | "inf" | "-inf"}``  a float that JSON cannot write
=====================================  ====================================================

``training_state.json`` is ``{"pieces": [{"name": <the piece's name>, "state": <tree>}, ...]}``, loaded by name.
Checkpoints written before the pieces had names hold their type's name (``LEGACY_NAMES`` says whose it is); a
converted checkpoint's pieces have no name (``null``: their order is all a pickle of them recorded, so they load in
the trainer's order).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ddpo_group.errors import CheckpointError
from ddpo_group.run.persistence.write_errors import writing

STATE_JSON = "training_state.json"
STATE_TENSORS = "training_state.safetensors"


# the names checkpoints written before the pieces were named by the trainer held: their pieces' types
LEGACY_NAMES = {"PromptSampler": "prompt_sampler", "TrainingState": "counters", "PerPromptStatTracker": "stat_tracker",
                "AdamW": "critic", "KLRegularizer": "kl", "GroupThresholdController": "estimator_controller",
                "EMAWeights": "ema", "OldModel": "old_model", "AdaptiveBranches": "adaptive_branching",
                "RestorePoint": "best_weights"}


def save_pieces(directory: Path, pieces: dict) -> None:
    """Write each piece's ``state_dict()`` under its name (``pieces``: {name: piece}) to ``directory`` (the
    training-state files)."""
    write_states(directory, [(name, piece.state_dict()) for name, piece in pieces.items()])


def write_states(directory: Path, states: list[tuple[str | None, dict]]) -> None:
    """Write named state dicts (name None: unknown) to ``directory``'s training-state files."""
    tensors: dict[str, torch.Tensor] = {}
    pieces = [{"name": name, "state": _encode(state, f"{index}", tensors, name or f"piece {index}")}
              for index, (name, state) in enumerate(states)]
    with writing(Path(directory) / STATE_TENSORS, "the training state's tensors"):
        save_file(tensors, str(Path(directory) / STATE_TENSORS))
    with writing(Path(directory) / STATE_JSON, "the training state"):
        (Path(directory) / STATE_JSON).write_text(json.dumps({"pieces": pieces}, allow_nan=False) + "\n")


def read_states(directory: Path) -> list[tuple[str | None, object]]:
    """The (name, state dict) of each piece in ``directory``'s training-state files; a CheckpointError names the
    file that cannot be read."""
    directory = Path(directory)
    json_path, tensors_path = directory / STATE_JSON, directory / STATE_TENSORS
    for path in (json_path, tensors_path):
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint holds no training state")
    try:
        tensors = load_file(str(tensors_path), device="cpu")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{tensors_path} cannot be read as safetensors ({error})") from None
    try:
        saved = json.loads(json_path.read_text())["pieces"]
        return [(entry["name"], _decode(entry["state"], tensors)) for entry in saved]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{json_path} is not a training-state file ({type(error).__name__}: {error})") from None


def load_pieces(directory: Path, pieces: dict) -> None:
    """Load the training-state files of ``directory`` into ``pieces`` ({name: piece}, the trainer's); a
    CheckpointError names the file and the pieces that do not fit."""
    saved = read_states(directory)
    names = list(pieces)
    optional = {name for name, piece in pieces.items() if getattr(piece, "missing_ok", False)}  # newer than the file
    required = [name for name in names if name not in optional]
    if all(name is None for name, _ in saved) and len(saved) in (len(names), len(required)):  # converted: by order
        states = {name: state for name, (_, state) in zip(names if len(saved) == len(names) else required, saved)}
    else:
        states = {LEGACY_NAMES.get(name, name): state for name, state in saved}
    if set(states) != set(names) and not set(names) - optional <= set(states) <= set(names):
        held = sorted(set(states) - set(names), key=str)
        missing = sorted(set(names) - set(states), key=str)
        raise CheckpointError(
            f"{Path(directory) / STATE_JSON} holds the pieces {sorted(states, key=str)}; this run has {names}"
            + (f": the checkpoint holds {held}, which this run has not" if held else "")
            + (f"{';' if held else ':'} this run has {missing}, which the checkpoint does not hold" if missing else "")
            + " (another config's checkpoint: its state_fields.json says which)")
    for name, piece in pieces.items():
        if name not in states:  # a piece newer than the checkpoint that may start afresh (``missing_ok``)
            continue
        try:
            piece.load_state_dict(states[name])
        except Exception as error:
            raise CheckpointError(f"{Path(directory) / STATE_JSON}: the state of {name} does not load "
                                  f"({type(error).__name__}: {error})") from error


def _encode(value, key: str, tensors: dict, where: str):
    """``value`` as JSON, its tensors added to ``tensors`` under their path from the piece (``where``: for errors)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, np.generic):  # a numpy scalar is stored as the Python number it equals
        return _encode(value.item(), key, tensors, where)
    if isinstance(value, torch.Tensor):
        name, copies = key, 0
        while name in tensors:  # a dict key holding "/" can repeat another's path
            copies += 1
            name = f"{key}#{copies}"
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()  # a copy: no storage shared with another
        return {"tensor": name}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{key}/{i}", tensors, where) for i, v in enumerate(value)]
        return {"tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"dict": {k: _encode(v, f"{key}/{k}", tensors, where) for k, v in value.items()}}
        if all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            return {"items": [[k, _encode(v, f"{key}/{k}", tensors, where)] for k, v in value.items()]}
    raise TypeError(f"the state of {where} holds a {type(value).__name__} at {key!r}; a checkpoint stores "
                    "tensors, numbers, strings, booleans, None, lists, tuples and dicts (string or int keys)")


def _decode(value, tensors: dict):
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    (kind, content), = value.items()
    if kind == "dict":
        return {k: _decode(v, tensors) for k, v in content.items()}
    if kind == "items":
        return {k: _decode(v, tensors) for k, v in content}
    if kind == "tuple":
        return tuple(_decode(v, tensors) for v in content)
    if kind == "tensor":
        if content not in tensors:
            raise KeyError(f"tensor {content!r} is not in {STATE_TENSORS}")
        return tensors[content]
    if kind == "float":
        return float(content)
    raise ValueError(f"unknown entry {kind!r}")
