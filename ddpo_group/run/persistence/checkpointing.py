"""Checkpoints: written to a temporary directory then renamed, proven by a manifest, loaded without unpickling.

Layout: ``<run_dir>/checkpoints/checkpoint_<epoch:05d>/`` holds accelerate's state (weights as safetensors, the
optimizer, the random states), the training state's pieces (run/persistence/state_files.py: safetensors + JSON), the files
``extra`` adds, ``COMPLETE`` and, written last, ``MANIFEST.json`` (run/persistence/manifest.py: size and sha256 of every file).
Only complete ones are resumed from or kept. A crash at any point of a save leaves every complete checkpoint written
before it, and at worst a hidden ``.tmp_*`` / ``.replaced_*`` / ``.deleting_*`` directory that the next save clears up
(a resume names it). A file that cannot be written (a full disk) stops the save with a WriteError naming it; the
unfinished checkpoint is removed at once. With several processes each writes its part (run/persistence/process_parts.py) into the
one directory; a failure on any of them stops every process at that step of the save (``save_checkpoint``).

The prepared models' weights (accelerate's ``model*.safetensors``) hold what training changes only
(``trained_weights``): the trainable parameters and every LoRA adapter's weights (the KL reference's and the old
model's adapters change without the optimizer). The frozen base weights and the buffers (SD3's position table) come
from the pretrained model the run loads again: a LoRA checkpoint of SD3.5 Medium holds megabytes, not its 4.5 GB
transformer. ``frozen_weights.json`` records the sum and norm of each weight left out. A resume checks that the file
holds every trained weight and nothing the model lacks, and that the model's other weights have the recorded sums
(the same pretrained model), then loads the file over the pretrained weights (checkpoints written with every weight,
without the record, load the same way).

A resume loads nothing from a checkpoint before it verifies: complete, no pickled training state (loading a pickle can
run any code it holds; ``scripts/convert_checkpoint.py`` converts one you trust), every file as its manifest says.
accelerate's own files load with ``weights_only=True``; the sharded state of an FSDP checkpoint, which
torch.distributed.checkpoint would unpickle, is read as plain data first (run/persistence/sharded_state.py). A run directory
resumes from its newest checkpoint that verifies; each newer one is named with the reason it was skipped.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from accelerate.utils import DistributedType, gather_object

from ddpo_group.errors import CheckpointError
from ddpo_group.reference.model import TEACHER_PREFIX
from ddpo_group.run.persistence.manifest import MANIFEST, manifest_problem, write_manifest
from ddpo_group.run.processes.process_failures import settle
from ddpo_group.run.persistence.process_parts import absent_parts, missing_part, parts_record, process_part, sync
from ddpo_group.run.persistence.resume_check import recorded_processes
from ddpo_group.run.persistence.sharded_state import sharded_state_problem
from ddpo_group.run.persistence.state_files import load_pieces, save_pieces, write_states
from ddpo_group.run.persistence.write_errors import WriteError, writing

CHECKPOINT_PATTERN = re.compile(r"^checkpoint_(\d+)$")
COMPLETE_MARKER = "COMPLETE"
PICKLED_STATE = "custom_checkpoint_*.pkl"  # accelerate's register_for_checkpointing files: never loaded
CONVERT_COMMAND = "python scripts/convert_checkpoint.py {checkpoint}"


class TrainingState:
    """Epoch and optimizer-step counters and the wandb run id, saved with every checkpoint."""

    def __init__(self):
        self.epoch = -1  # last finished epoch
        self.global_step = 0
        self.wandb_run_id = ""  # set at the first start; a resumed run logs to the same wandb run
        self.sizes = {}  # what "auto" settings resolved to (update/memory_fit.py): a resumed run keeps them
        self.supervised_steps = 0  # the optimizer steps of the supervised epochs (sft.epochs), within global_step

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "global_step": self.global_step, "wandb_run_id": self.wandb_run_id,
                "sizes": dict(self.sizes), "supervised_steps": self.supervised_steps}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.wandb_run_id = str(state.get("wandb_run_id", ""))  # older checkpoints have none
        self.sizes.clear()  # in place: the chunk-size resolver holds this dict
        self.sizes.update(state.get("sizes", {}))
        self.supervised_steps = int(state.get("supervised_steps", 0))  # older checkpoints: none


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


def checkpoint_problem(checkpoint: Path) -> str | None:
    """None when ``checkpoint`` can be loaded safely, else why not, naming the first file at fault."""
    if not (checkpoint / COMPLETE_MARKER).exists():
        return f"{checkpoint} is incomplete: it has no {COMPLETE_MARKER} marker (its save did not finish)"
    pickled = sorted(checkpoint.glob(PICKLED_STATE))
    if pickled:
        return (f"{pickled[0]} is a pickle, and loading a pickle can run any code it holds, so it is not loaded; "
                f"if you trust this checkpoint, convert it with: {CONVERT_COMMAND.format(checkpoint=checkpoint)}")
    # every process's part, then every file as the manifest says, then FSDP's sharded state
    return (missing_part(checkpoint, recorded_processes(checkpoint)) or manifest_problem(checkpoint)
            or sharded_state_problem(checkpoint))


def _epoch(path: Path) -> int | None:
    match = CHECKPOINT_PATTERN.match(path.name)
    return int(match.group(1)) if match else None


def _candidates(root: Path) -> list[Path]:
    """Directories named like checkpoints under ``root`` (complete or not), newest epoch first."""
    if not root.is_dir():
        return []
    found = [(_epoch(p), p) for p in root.iterdir() if p.is_dir() and _epoch(p) is not None]
    return [path for _, path in sorted(found, reverse=True)]


def fallback_hint(checkpoint: Path, next_step: Callable[[Path], str]) -> str:
    """What to do when ``checkpoint`` cannot be resumed: resume from the newest earlier checkpoint that verifies
    (``next_step(path)``: the command to paste), or start a new run."""
    epoch = _epoch(checkpoint)
    for earlier in _candidates(checkpoint.parent) if epoch is not None else []:
        if _epoch(earlier) < epoch and checkpoint_problem(earlier) is None:
            return f"resume from {earlier.name}, the newest earlier checkpoint that verifies: {next_step(earlier)}"
    return "no earlier checkpoint of this run verifies: start a new run (another run_name, no resume_from)"


def resolve_resume_path(resume_from: str, next_step: Callable[[Path], str] = lambda path: f"--config.resume_from="
                        f"{path}") -> tuple[Path, list[str]]:
    """The checkpoint to resume and what was skipped on the way: ``resume_from`` is a checkpoint directory (it must
    verify), or a run directory whose newest checkpoint that verifies is taken (each newer one skipped, with why);
    what unfinished saves left beside it is named too.
    A CheckpointError names the file at fault and the next step (``next_step(path)``: how to resume from ``path``)."""
    path = Path(resume_from).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"resume_from={resume_from!r} does not exist")
    if (path / COMPLETE_MARKER).exists() or _epoch(path) is not None:
        problem = checkpoint_problem(path)
        if problem is not None:
            raise CheckpointError(f"resume_from={resume_from!r} cannot be resumed: {problem}. "
                                  f"{fallback_hint(path, next_step)}")
        return path, _leftover_notes(path.parent)
    skipped = []
    for root in (path / "checkpoints", path):
        for checkpoint in _candidates(root):
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                return checkpoint, skipped + _leftover_notes(root)
            skipped.append(f"skipped {checkpoint.name}: {problem}")
        if skipped:
            raise CheckpointError(f"resume_from={resume_from!r}: no checkpoint verifies:\n  - "
                                  + "\n  - ".join(skipped) + "\nstart a new run (another run_name, no resume_from)")
    raise FileNotFoundError(
        f"resume_from={resume_from!r} is neither a complete checkpoint nor a run directory holding one "
        f"(looked for checkpoints/checkpoint_<epoch>/{COMPLETE_MARKER})"
    )


# the best evaluation's weights in the run directory (run/guard.py): a LoRA in diffusers format, or full fine-tuning's
# trained weights (model.safetensors); BEST_RECORD names the evaluation
BEST_LORA, BEST_WEIGHTS, BEST_RECORD = "lora_best", "best", "best.json"
ADAPTER_WEIGHT = "lora_"  # in the name of every LoRA adapter's weight (peft: lora_A, lora_B, lora_magnitude_vector)
FROZEN_WEIGHTS = "frozen_weights.json"  # what a checkpoint leaves out, summed: checked against the model on resume


def best_weights(run_dir: Path) -> str | None:
    """The kept weights of a run's best evaluation and which it was ("<dir> (epoch E, <measure> S)"), or None."""
    for name in (BEST_LORA, BEST_WEIGHTS):
        record = Path(run_dir) / name / BEST_RECORD
        if record.is_file():
            best = json.loads(record.read_text())
            where = " on the half of its images it was not chosen on" if "reported_on" in best else ""
            return f"{record.parent} (epoch {best['epoch']}, {best['measure']} {best['score']:.4f}{where})"
    return None


def trained_weights(model) -> set[str]:
    """State-dict names of ``model`` (as prepared: accelerate's names) a checkpoint keeps: the trainable parameters
    and every LoRA adapter's weights, trained or not, but a distillation teacher's (kept by reference and
    fingerprinted with the frozen weights: reference/teachers.py)."""
    return {name for name, param in model.named_parameters(remove_duplicate=False)
            if param.requires_grad or (ADAPTER_WEIGHT in name and f".{TEACHER_PREFIX}" not in name)}


def frozen_fingerprint(model, kept: set[str]) -> dict[str, list]:
    """{name: [shape, sum, 2-norm]} (float64) of every state-dict entry of ``model`` a checkpoint leaves out (not in
    ``kept``, its ``trained_weights``): the pretrained weights under the adapters, and the buffers."""
    frozen = {name: tensor for name, tensor in model.state_dict().items() if name not in kept}
    if not frozen:
        return {}
    device = next(iter(frozen.values())).device
    with torch.no_grad():  # one transfer for all the sums (no host sync per tensor)
        sums = torch.stack([_sum_and_norm(t).to(device) for t in frozen.values()]).tolist()
    return {name: [list(t.shape), *sums[i]] for i, (name, t) in enumerate(frozen.items())}


def _sum_and_norm(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_complex():  # a rotary table: its real and imaginary parts
        tensor = torch.view_as_real(tensor)
    elif not tensor.is_floating_point():  # an integer or boolean buffer: small
        tensor = tensor.to(torch.float64)
    return torch.stack([tensor.sum(dtype=torch.float64), torch.linalg.vector_norm(tensor, dtype=torch.float64)])


@contextmanager
def trained_weights_only(accelerator):
    """Within it, ``accelerator.save_state`` writes the prepared models' ``trained_weights`` only, with the
    ``frozen_fingerprint`` of the rest, and ``accelerator.load_state`` checks a checkpoint's weights and fingerprint
    against the model first (module docstring). Models accelerate saves its own way (FSDP's sharded state) are left as
    they are."""
    hooks = [accelerator.register_save_state_pre_hook(_drop_untrained),
             accelerator.register_load_state_pre_hook(_check_trained)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _drop_untrained(models, weights, output_dir) -> None:
    from accelerate import PartialState

    fingerprints = {}
    for i, (model, state) in enumerate(zip(models, weights)):  # weights: the state dicts accelerate is about to
        kept = trained_weights(model)                           # write (none for FSDP's)
        fingerprints[str(i)] = frozen_fingerprint(model, kept)
        for name in [name for name in state if name not in kept]:
            del state[name]
    if fingerprints and PartialState().is_main_process:
        (Path(output_dir) / FROZEN_WEIGHTS).write_text(json.dumps(fingerprints))


def _check_trained(models, input_dir) -> None:
    from safetensors import safe_open

    recorded = Path(input_dir) / FROZEN_WEIGHTS
    fingerprints = json.loads(recorded.read_text()) if recorded.exists() else {}
    for i, model in enumerate(models):
        path = Path(input_dir) / f"model{f'_{i}' if i else ''}.safetensors"
        if not path.exists():  # FSDP's sharded state, or torch's .bin: accelerate's strict loading
            continue
        with safe_open(str(path), framework="pt") as file:
            names = set(file.keys())
        # a weight under several names (tied) is present when one of them is: safetensors keeps one
        params = dict(model.named_parameters(remove_duplicate=False))
        aliases: dict[int, set[str]] = {}
        for name, param in params.items():
            aliases.setdefault(id(param), set()).add(name)
        kept = trained_weights(model)
        missing = {name for name in kept if not aliases[id(params[name])] & names}
        unknown = names - set(model.state_dict())
        if missing or unknown:
            raise CheckpointError(f"{path} does not match the model: {_some(missing)} missing, {_some(unknown)} "
                                  f"unknown to it (a checkpoint of another model, LoRA setting or adapter set?)")
        if str(i) in fingerprints:
            _check_frozen(fingerprints[str(i)], frozen_fingerprint(model, kept), recorded)


def _check_frozen(saved: dict, now: dict, recorded: Path) -> None:
    """The weights the checkpoint left out are the ones it was trained on: same names and shapes, sum and norm within
    float64 rounding of another summation order (another device): the sum within 1e-10 sqrt(n) |w|, which bounds
    it, the norm within 1e-9 of itself."""
    def same(a: list, b: list) -> bool:
        (shape, total, norm), (shape_b, total_b, norm_b) = a, b
        largest = max(norm, norm_b)
        return (shape == shape_b and abs(norm - norm_b) <= 1e-9 * largest
                and abs(total - total_b) <= 1e-10 * math.sqrt(math.prod(shape)) * largest)

    differ = sorted(set(saved) ^ set(now)) or [name for name in saved if not same(saved[name], now[name])]
    teachers = {name for name in differ if f".{TEACHER_PREFIX}" in name}
    if teachers:
        raise CheckpointError(f"{recorded}: the distillation teachers' weights are not those this checkpoint was "
                              f"distilled from ({_some(teachers)} differ): resume with the same opd.teachers")
    if differ:
        raise CheckpointError(f"{recorded}: the model's frozen weights are not those this checkpoint was trained on "
                              f"({_some(set(differ))} differ): resume with the pretrained.model (and revision) the "
                              f"run started from")


def _some(names: set[str], shown: int = 3) -> str:
    listed = ", ".join(sorted(names)[:shown])
    return f"{len(names)} weight(s)" + (f" ({listed}{', ...' if len(names) > shown else ''})" if names else "")


def load_checkpoint(accelerator, checkpoint: Path, pieces: dict) -> None:
    """Load a verified checkpoint: accelerate's state (``weights_only=True``: plain data only), then ``pieces``
    ({name: piece}: run/persistence/state_files.py). A CheckpointError names the checkpoint or file that does not load."""
    from accelerate.utils import load

    random_states = checkpoint / f"random_states_{accelerator.process_index}.pkl"
    if random_states.exists():  # accelerate only logs a failure to load them: the resume would not be exact
        try:
            load(random_states)
        except Exception as error:
            raise CheckpointError(f"{random_states} does not load as plain data ({type(error).__name__}: "
                                  f"{error})") from None
    try:
        with trained_weights_only(accelerator):  # strict=False: the frozen weights are the pretrained ones already
            accelerator.load_state(str(checkpoint), load_kwargs={"weights_only": True}, strict=False)
    except CheckpointError:
        raise
    except Exception as error:
        culprit = _first_unloadable(checkpoint, load) or checkpoint  # torch's error does not name the file
        raise CheckpointError(f"{culprit}: accelerate cannot load it ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from error
    load_pieces(checkpoint, pieces)


def _first_unloadable(checkpoint: Path, load) -> Path | None:
    """The first of accelerate's torch-saved files in ``checkpoint`` that does not load as plain data (after a
    failed load only: it reads them all again)."""
    for path in sorted([*checkpoint.glob("*.bin"), *checkpoint.glob("*.pkl")]):
        try:
            load(path, map_location="cpu")
        except Exception:
            return path
    return None


def convert_pickled_checkpoint(checkpoint: Path) -> list[Path]:
    """Rewrite a trusted checkpoint's pickled training state (accelerate's ``custom_checkpoint_<i>.pkl``, unpickled
    here: run only on a checkpoint you trust) as the training-state files, remove the pickles and write the
    manifest. Returns the pickles converted."""
    import torch

    checkpoint = Path(checkpoint)
    if not (checkpoint / COMPLETE_MARKER).exists():
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (no {COMPLETE_MARKER}): nothing to convert")
    pickled = sorted(checkpoint.glob(PICKLED_STATE), key=lambda p: int(re.sub(r"\D", "", p.name)))
    if not pickled:
        raise CheckpointError(f"{checkpoint} holds no {PICKLED_STATE}: nothing to convert")
    write_states(checkpoint, [(None, torch.load(path, map_location="cpu", weights_only=False)) for path in pickled])
    for path in pickled:
        path.unlink()
    write_manifest(checkpoint)
    return pickled


def run_dir_of_checkpoint(checkpoint: Path) -> Path:
    return checkpoint.parent.parent


def later_checkpoints(checkpoint: Path) -> list[Path]:
    """Complete checkpoints beside ``checkpoint`` of later epochs (a resume from an older one abandons them)."""
    siblings = complete_checkpoints(checkpoint.parent)
    names = [p.name for p in siblings]
    return siblings[names.index(checkpoint.name) + 1 :] if checkpoint.name in names else []


LEFTOVERS = (".tmp_checkpoint_*", ".replaced_checkpoint_*", ".deleting_checkpoint_*")  # a save's, while it runs


def leftovers(root: Path) -> list[Path]:
    """What saves that never finished (a kill, a lost machine) left in ``root``."""
    return sorted(path for pattern in LEFTOVERS for path in Path(root).glob(pattern))


def _leftover_notes(root: Path) -> list[str]:
    return [f"{path} is what a save that never finished left (never resumed from; the next save removes it)"
            for path in leftovers(root)]


def clear_leftovers(root: Path) -> None:
    """Remove what an interrupted save left in ``root``; a complete checkpoint moved aside to be replaced by a
    new save of its epoch goes back into place if that save never finished."""
    for replaced in root.glob(".replaced_checkpoint_*"):
        original = root / replaced.name[len(".replaced_"):]
        if (replaced / COMPLETE_MARKER).exists() and not (original / COMPLETE_MARKER).exists():
            shutil.rmtree(original, ignore_errors=True)
            os.replace(replaced, original)
    for leftover in leftovers(root):
        shutil.rmtree(leftover, ignore_errors=True)


def checkpoint_dir(checkpoint_root: str | os.PathLike, epoch: int) -> Path:
    """Where the checkpoint of finished epoch ``epoch`` lives (complete once it holds COMPLETE)."""
    return Path(checkpoint_root) / f"checkpoint_{epoch:05d}"


@contextmanager
def _every_process(accelerator, final: Path):
    """One step of a save, on every process: an error of it on any process stops every process at its end
    (run/processes/process_failures.py: settle); a write that failed says that ``final`` was not saved."""
    error = None
    try:
        yield
    except Exception as raised:  # every error of the step: shared with the others, then raised again
        error = raised
        if isinstance(raised, WriteError):
            error = WriteError(f"{raised}; {final.name} was not saved (its unfinished files are removed)")
            error.__cause__ = raised
    settle(accelerator, error)


def save_checkpoint(
    accelerator, checkpoint_root: str | os.PathLike, epoch: int, keep: int, pieces: dict | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Save the accelerate state and ``pieces`` ({name: an object with ``state_dict``}) for ``epoch`` atomically, with its
    manifest; keep the newest ``keep`` complete checkpoints.

    Every process writes its part of accelerate's state (its random states; under FSDP its shards of the weights and
    the optimizer) into the one temporary directory and syncs it; then the main process checks that every process's
    part is there (run/persistence/process_parts.py), adds the training state and ``extra(directory)`` (e.g. the diffusers-format
    LoRA in ``lora/``), syncs, marks the checkpoint complete, writes the manifest listing each process's files and
    renames it into place. A failure on any process at any step stops every process at the end of that step, the
    unfinished checkpoint removed (``_every_process``); every complete checkpoint stays.
    """
    root = Path(checkpoint_root)
    final = checkpoint_dir(root, epoch)
    tmp = root / f".tmp_{final.name}"
    main, rank = accelerator.is_main_process, accelerator.process_index
    try:
        with _every_process(accelerator, final):
            if main:
                root.mkdir(parents=True, exist_ok=True)
                clear_leftovers(root)
        with _every_process(accelerator, final):
            what = ("accelerate's state: the weights, the optimizer, the random states" if main else
                    f"process {rank}'s part of accelerate's state: its random states"
                    f"{', its shards of the weights and the optimizer' if _sharded(accelerator) else ''}")
            with writing(tmp, what), trained_weights_only(accelerator):
                accelerator.save_state(str(tmp))
            with writing(tmp, f"process {rank}'s part of the checkpoint, synced to the disk"):
                part = process_part(tmp, rank)
        parts = gather_object([part]) if accelerator.num_processes > 1 else [part]
        with _every_process(accelerator, final):
            if main:
                _complete(tmp, epoch, parts, pieces, extra)
                _into_place(root, tmp, final, keep)
    except BaseException:
        if main:  # the unfinished checkpoint goes, every complete one stays
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _sharded(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def _complete(tmp: Path, epoch: int, parts: list[dict[str, int]], pieces: dict | None, extra) -> None:
    """On the main process: every process's part checked, the training state and ``extra`` added, every file synced,
    then ``COMPLETE`` and, last, the manifest with each process's files."""
    absent = absent_parts(tmp, parts)
    if absent is not None:
        raise CheckpointError(absent)
    save_pieces(tmp, dict(pieces or {}))
    if extra is not None:
        with writing(tmp, "the files the run adds to a checkpoint"):
            extra(tmp)
    with writing(tmp, "the checkpoint's files, synced to the disk"):
        sync(sorted(path for path in tmp.rglob("*") if path.is_file()))
    with writing(tmp / COMPLETE_MARKER, "the marker of a complete checkpoint"):
        (tmp / COMPLETE_MARKER).write_text(f"epoch {epoch}\n")
    write_manifest(tmp, parts_record(parts))  # last: it proves every file written before it
    with writing(tmp, "the complete checkpoint, synced to the disk"):
        sync([tmp / COMPLETE_MARKER, tmp / MANIFEST])


def _into_place(root: Path, tmp: Path, final: Path, keep: int) -> None:
    """On the main process: the complete checkpoint renamed into place, then the rotation."""
    if final.exists():  # the same epoch saved again: move the old one aside, never leave neither
        stale = root / f".replaced_{final.name}"
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, final)
    # rotation: the newest ``keep`` by epoch, and never the checkpoint just written; each is renamed out of the
    # checkpoint pattern first, so a crash while deleting never leaves a half-deleted "complete" one
    for old in complete_checkpoints(root)[:-keep]:
        if old != final:
            doomed = root / f".deleting_{old.name}"
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
