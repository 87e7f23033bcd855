"""Whether a checkpoint can be resumed by this config, checked before any model loads.

Every checkpoint records the fields that decide what its state holds (``state_fields.json``):
the trainable parameters (LoRA or full, rank), which optional pieces exist (critic, reference,
group-threshold controller, the KL controller's kind, the fp16 scaler, the 8-bit optimizer, the EMA
of the weights), whether FSDP sharded its weights and optimizer or they are whole (DDP, or one process), and how many
processes wrote it. Resuming with other values would load state into the wrong objects, or fail deep inside
accelerate; here it is a ConfigError naming each field, before heavy work. Another process count is resumed on
purpose, with one warning that says what continues exactly and what does not (``process_count_note``).

``checkpoint_format`` numbers the order in which the training state's pieces are stored: 1 before
the package layout of run/session.py (checkpoints without the field), 2 since (the KL term's controller
and reference are one piece, registered only with a reference model). Another format cannot be resumed. Pieces
added since are appended last and only when their field (in STATE_FIELDS, with ADDED_FIELDS' value for older
checkpoints) says so: the EMA (``train.ema``), so format-2 checkpoints without it keep loading.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddpo_group.registry import read_field
from ddpo_group.errors import ConfigError
from ddpo_group.run.command.renamed_fields import new_name

STATE_FIELDS_FILE = "state_fields.json"
CHECKPOINT_FORMAT = 2
# fields that change which objects a checkpoint holds, or their shapes
STATE_FIELDS = (
    "use_lora", "lora_rank", "algorithm.adv_estimator", "kl.controller", "kl.use_reference_model",
    "train.use_8bit_adam", "mixed_precision", "critic.hidden_dim", "train.ema", "critic.input",
)
# fields added to STATE_FIELDS later, with the value every checkpoint written before them had
ADDED_FIELDS = {"train.ema": False, "critic.input": "latent"}


DISTRIBUTED = "distributed"  # "FSDP": weights and optimizer sharded by torch.distributed.checkpoint; "DDP": whole
FSDP_DIRECTORIES = "pytorch_model_fsdp_*"  # accelerate's FSDP model state (a checkpoint without the field: its files)


def distribution(sharded: bool) -> str:
    return "FSDP" if sharded else "DDP"


def state_fields(config, num_processes: int, sharded: bool = False) -> dict:
    """The values a resume must match (plus the model and process count, which only warn); ``sharded``: FSDP shards
    the weights and the optimizer."""
    fields = {name: read_field(config, name) for name in STATE_FIELDS}
    fields["kl.reference_update_freq > 0"] = read_field(config, "kl.reference_update_freq") > 0  # a second LoRA adapter
    fields["model family"] = _family(config)  # another family's denoiser has other weights
    fields["pretrained.model"] = config.pretrained.model
    fields["checkpoint_format"] = CHECKPOINT_FORMAT
    fields[DISTRIBUTED] = distribution(sharded)
    fields["num_processes"] = num_processes
    return fields


def _family(config) -> str:
    from ddpo_group.models.families import family_name

    try:
        return family_name(config.pretrained.model, config.pretrained.family)
    except (OSError, ValueError, KeyError):  # the model is not there: its load will say so
        return config.pretrained.family or "unknown"


def _current_name(key: str) -> str:
    """A recorded field's current name (checkpoints written before a rename hold the former one)."""
    name, space, condition = key.partition(" ")
    return (new_name(name) or name) + space + condition


def write_state_fields(directory: Path, config, num_processes: int, sharded: bool = False) -> None:
    fields = state_fields(config, num_processes, sharded)
    (Path(directory) / STATE_FIELDS_FILE).write_text(json.dumps(fields, indent=2) + "\n")


def recorded_processes(checkpoint: Path) -> int | None:
    """The number of processes that wrote ``checkpoint``, as its state_fields.json records it (None: unknown)."""
    try:
        return int(json.loads((Path(checkpoint) / STATE_FIELDS_FILE).read_text())["num_processes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_resume(checkpoint: Path, config, num_processes: int, sharded: bool = False) -> list[str]:
    """Raise ConfigError if ``checkpoint`` holds state this config (and launch: ``num_processes``, ``sharded``) cannot
    load; return warnings (model path or process count changed: loadable, but not an exact continuation). Checkpoints
    without the file pass."""
    path = Path(checkpoint) / STATE_FIELDS_FILE
    if not path.exists():
        return []
    saved = {**ADDED_FIELDS, **{_current_name(key): value for key, value in json.loads(path.read_text()).items()}}
    saved.setdefault(DISTRIBUTED, distribution(any(Path(checkpoint).glob(FSDP_DIRECTORIES))))
    written = saved.get("checkpoint_format", 1)
    if written != CHECKPOINT_FORMAT:
        raise ConfigError(
            f"resume_from={str(checkpoint)!r} has checkpoint format {written}, written by another ddpo_group version "
            f"(this one reads format {CHECKPOINT_FORMAT}: the training state's pieces are stored in another order); "
            "finish that run with the version that wrote it, or start a new run. Its weights stay usable: its lora/ "
            "directory loads in diffusers and scripts/evaluate.py --finetuned reads the checkpoint"
        )
    now = state_fields(config, num_processes, sharded)
    if saved[DISTRIBUTED] != now[DISTRIBUTED]:
        raise ConfigError(_distribution_changed(checkpoint, saved[DISTRIBUTED]))
    soft = ("pretrained.model", "num_processes")
    wrong = [f"{name}: checkpoint {saved[name]!r}, config {now[name]!r}"
             for name in now if name in saved and name not in soft and saved[name] != now[name]]
    if wrong:
        raise ConfigError(
            f"resume_from={str(checkpoint)!r} cannot be resumed with this config; these fields differ:\n  - "
            + "\n  - ".join(wrong)
            + "\nset them as in the checkpoint (its run's config.json), or start a new run (another run_name, no resume_from)"
        )
    warnings = []
    if "pretrained.model" in saved and saved["pretrained.model"] != now["pretrained.model"]:
        warnings.append(f"pretrained.model is {now['pretrained.model']!r}; the checkpoint was trained from "
                        f"{saved['pretrained.model']!r} (fine if it is the same model at another path)")
    if saved.get("num_processes", num_processes) != num_processes:
        warnings.append(process_count_note(saved["num_processes"], num_processes, sharded))
    return warnings


def process_count_note(saved: int, now: int, sharded: bool) -> str:
    """The one warning of a resume on another process count: what continues exactly, what does not."""
    if now > saved:
        fresh = f"process {saved} starts" if now == saved + 1 else f"processes {saved}..{now - 1} start"
        random = f"{fresh} from the seed's random states (seed + process index), which the checkpoint does not hold"
    else:
        unused = f"process {now}'s" if saved == now + 1 else f"processes {now}..{saved - 1}'s"
        random = f"{unused} random states are not used"
    weights = "resharded by torch.distributed.checkpoint" if sharded else "loaded by every process"
    return (f"the checkpoint was written by {saved} process(es), this run has {now}: the weights and the optimizer "
            f"state ({weights}) and every piece of the training state (the prompt sampler, the counters, the stat "
            f"tracker, the controllers) continue exactly as saved; the run is not the exact continuation of a run on "
            f"{saved}: {random}, and each process samples another slice of an epoch's prompts")


def _distribution_changed(checkpoint: Path, written: str) -> str:
    if written == "FSDP":
        how = ("its weights and optimizer are sharded (torch.distributed.checkpoint: pytorch_model_fsdp_0/, "
               "optimizer_0/); this launch keeps them whole (DDP or one process): launch it with the FSDP accelerate "
               "config it was written under (config/accelerate/fsdp_*.yaml, any number of processes)")
    else:
        how = ("its weights and optimizer are whole (model.safetensors, optimizer.bin); this launch shards them with "
               "FSDP: launch it without the FSDP accelerate config (DDP: config/accelerate/multi_gpu.yaml, or one "
               "process)")
    return (f"resume_from={str(checkpoint)!r} was written under {written}: {how}. A checkpoint is not converted "
            "between the two (FSDP's sharded optimizer state is keyed by parameter name, DDP's by position); or start "
            "a new run (another run_name, no resume_from)")
