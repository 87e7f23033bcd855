"""The sharded state of an FSDP checkpoint, proven to be plain data before torch.distributed.checkpoint loads it.

With ``fsdp_state_dict_type: SHARDED_STATE_DICT`` accelerate saves the model and the optimizer through
torch.distributed.checkpoint (DCP): a directory per model and optimizer (``pytorch_model_fsdp_0/``, ``optimizer_0/``)
holding a ``.metadata`` file and one ``.distcp`` file per process. DCP reads the tensors with ``weights_only=True``, but
it unpickles ``.metadata`` with plain ``pickle.load`` and the non-tensor values (the optimizer's hyperparameters) with
``torch.load(weights_only=False)``: either can run any code a changed file holds. ``sharded_state_problem`` reads
them first the safe way: ``.metadata`` with an unpickler that builds only DCP's metadata records and torch's dtypes,
layouts and sizes, each non-tensor value with ``torch.load(weights_only=True)``; it names the first file that holds
anything else, or that the metadata names and is missing (a process's shard).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem, metadata

METADATA = ".metadata"  # DCP's file name (with a rank prefix when saved without collectives)
RECORDS = {  # (module, name) of the classes a DCP metadata file is made of
    (metadata.__name__, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                           "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
                                           "StorageMeta", "MetadataIndex")
} | {(filesystem.__name__, "_StorageInfo"), ("torch", "Size"), ("collections", "OrderedDict"),
     ("torch.serialization", "_get_layout")}  # a layout by its name (torch.strided)
PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}  # the checkpoint id: the path it was saved to


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records, torch's sizes / dtypes / layouts / memory formats, paths and nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) in RECORDS or (module.split(".")[0] == "pathlib" and name in PATHS):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(path: Path):
    """A DCP ``.metadata`` file, unpickled without building anything but its records (pickle.UnpicklingError else)."""
    with open(path, "rb") as handle:
        loaded = _MetadataUnpickler(handle).load()
    if not isinstance(loaded, metadata.Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(loaded).__name__}, not DCP's Metadata")
    return loaded


def _values_problem(directory: Path, loaded) -> str | None:
    """None when every non-tensor value DCP would unpickle from ``directory`` loads with weights_only=True."""
    for index, info in (loaded.storage_data or {}).items():
        if not isinstance(loaded.state_dict_metadata.get(index.fqn), metadata.BytesStorageMetadata):
            continue  # a tensor: DCP loads it with weights_only=True
        path = directory / info.relative_path
        if getattr(info, "transform_descriptors", None):
            return f"{path}: {index.fqn!r} is stored through {list(info.transform_descriptors)}, which this run does " \
                   "not write"
        with open(path, "rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as error:
            return f"{path}: the value {index.fqn!r} does not load as plain data ({type(error).__name__}: " \
                   f"{str(error).splitlines()[0] if str(error) else ''})"
    return None


def sharded_state_problem(checkpoint: Path) -> str | None:
    """None when every DCP directory of ``checkpoint`` holds plain data only, else what is wrong, naming the file."""
    for path in sorted(Path(checkpoint).rglob(f"*{METADATA}")):
        if not path.is_file():
            continue
        try:
            loaded = read_metadata(path)
        except Exception as error:
            return f"{path} does not load as plain data ({type(error).__name__}: {error})"
        problem = _absent_file(path, loaded) or _values_problem(path.parent, loaded)
        if problem is not None:
            return problem
    return None


def _absent_file(path: Path, loaded) -> str | None:
    """None when every file the DCP metadata ``path`` names is beside it, else the first one missing (one per process:
    ``__<process>_<n>.distcp``)."""
    for index, info in sorted((loaded.storage_data or {}).items(),
                              key=lambda item: (str(item[1].relative_path), item[0].fqn)):
        file = path.parent / info.relative_path
        if not file.is_file():
            owner = re.match(r"__(\d+)_", str(info.relative_path))
            whose = f", process {owner.group(1)}'s shard" if owner else ""
            return f"{file} is missing: {path} keeps {index.fqn!r} in it{whose}"
    return None
