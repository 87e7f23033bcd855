"""The teachers of on-policy distillation (``algorithm.objective="opd"``): frozen denoisers that score the student's own
recorded steps (algorithms/objectives.py's ``opd_kl``; update/distillation_update.py).

``opd.teachers`` names each teacher and where its weights are ({name: path}):

* a LoRA adapter in diffusers format (a directory holding ``pytorch_lora_weights.safetensors``: a run's ``lora/`` or
  ``lora_best/``, a checkpoint's ``lora/``, or a run directory holding ``lora/``): loaded by the family's own loader
  (``pipe.load_lora_weights``) as one more adapter, ``teacher_<name>``, on the student's denoiser. The teachers share
  the student's base weights: no second copy, and a teacher's forward is the denoiser's with its adapter active.
* a denoiser directory in diffusers format (``config.json`` + weights: a model fine-tuned in full, or another member of
  the family on the same latents and text encoder): loaded by the student's denoiser class, a frozen copy.

Each row's teacher: with ``opd.route_key`` the teacher its prompt's metadata names (``metadata[route_key]``, one teacher
a task); without, every teacher scores every row and a row's loss is the mean of its KLs to them.

A checkpoint keeps the teachers by reference: their paths, and their weights' fingerprint beside the base model's (the
adapters are left out of the saved weights, run/persistence/checkpointing.py); a resumed run loads them from the same
paths and is refused when a teacher is missing or its weights changed.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

import torch

from ddpo_group.algorithms.objectives import get_objective
from ddpo_group.models.lora_export import lora_dir_of
from ddpo_group.reference.model import POLICY_ADAPTER, TEACHER_PREFIX, lora_layers


def teacher_paths(value) -> dict[str, str]:
    """``opd.teachers`` as {name: path}: a dict, or one path (its teacher named "teacher")."""
    if isinstance(value, str):
        return {"teacher": value} if value else {}
    return {str(name): str(path) for name, path in dict(value or {}).items()}


def teacher_errors(config) -> list[str]:
    """The opd section against the objective: teachers named for opd (and only for it), weights and route."""
    opd, errors = config.opd, []
    teachers = teacher_paths(opd.teachers)
    distilling = config.algorithm.objective == "opd"
    if not distilling:
        if teachers:
            errors.append(f"opd.teachers={teachers} names teachers, but algorithm.objective="
                          f"{config.algorithm.objective!r} does not distil: set algorithm.objective='opd' (or opd.teachers={{}})")
        return errors
    if not teachers:
        errors.append("algorithm.objective='opd' distils from teachers, but opd.teachers is empty: name them, e.g. "
                      "--config.opd.teachers='{\"aesthetic\": \"runs/aesthetic/lora\", \"ocr\": \"runs/ocr/lora\"}'")
    for name, path in teachers.items():
        if not name.replace("_", "").isalnum():
            errors.append(f"opd.teachers: the name {name!r} must be letters, digits and underscores")
        if lora_dir_of(path) is None and not (Path(path) / "config.json").is_file():
            errors.append(f"opd.teachers[{name!r}]={path!r} is neither a LoRA directory (holding "
                          "pytorch_lora_weights.safetensors, or a run directory with lora/) nor a denoiser directory "
                          "(config.json and its weights)")
    if not opd.beta >= 0:
        errors.append(f"opd.beta={opd.beta} must be >= 0")
    if not opd.reward_weight >= 0:
        errors.append(f"opd.reward_weight={opd.reward_weight} must be >= 0 (0: distillation alone)")
    if opd.beta == 0 and opd.reward_weight == 0:
        errors.append("opd.beta=0 and opd.reward_weight=0 leave no loss: give the teachers' KL a weight")
    if opd.reward_weight > 0:
        from ddpo_group.algorithms import get_policy_loss

        if not get_policy_loss(config.algorithm.policy_loss).per_step:
            errors.append(f"opd.reward_weight={opd.reward_weight} adds the policy loss to the per-step KL, but "
                          f"algorithm.policy_loss={config.algorithm.policy_loss!r} is one loss a trajectory: use a "
                          "per-step loss (vanilla, the default) or opd.reward_weight=0")
    return errors


class Teachers:
    """The frozen teachers (module docstring): their forwards on the student's recorded steps, each row's teacher."""

    def __init__(self, model, family, paths: dict[str, str], route_key: str = "", reduce: str = "mean"):
        """``model``: the unwrapped student denoiser (``family.model``), before accelerate wraps it."""
        self.paths = {name: str(Path(path).resolve()) for name, path in paths.items()}
        self.route_key = route_key
        self.reduce = reduce
        self.copies: dict[str, torch.nn.Module] = {}  # a denoiser directory's teacher
        self.adapters: list[str] = []  # the LoRA teachers' adapter names
        policy_adapter = POLICY_ADAPTER in getattr(model, "peft_config", {})
        trainable = [p for p in model.parameters() if p.requires_grad]
        for name, path in self.paths.items():
            lora = lora_dir_of(path)
            if lora is not None:
                adapter = TEACHER_PREFIX + name
                family.load_lora(family.pipe, lora, adapter_name=adapter)
                self.adapters.append(adapter)
            else:
                teacher = type(model).from_pretrained(path, torch_dtype=next(model.parameters()).dtype)
                self.copies[name] = teacher.to(next(model.parameters()).device).requires_grad_(False).eval()
        if self.adapters:  # the student's own adapter active again (or none: full fine-tuning), its weights trainable
            if policy_adapter:
                model.set_adapter(POLICY_ADAPTER)
            else:
                model.disable_adapters()
        self.frozen = [weights[adapter].weight for layer in lora_layers(model) for weights in (layer.lora_A, layer.lora_B)
                       for adapter in self.adapters if adapter in weights]  # the teachers' adapter weights
        self.policy_adapter = policy_adapter
        self.refreeze(trainable)

    @classmethod
    def from_config(cls, config, family) -> "Teachers | None":
        """None unless ``algorithm.objective`` distils (build before accelerate wraps the denoiser)."""
        if get_objective(config.algorithm.objective).kind != "distillation":
            return None
        return cls(family.model, family, teacher_paths(config.opd.teachers), config.opd.route_key,
                   config.sample.log_prob_reduce)

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    @contextmanager
    def applied(self, model, name: str):
        """The module computing teacher ``name``'s output; ``model``: the unwrapped student. Use under no_grad; the
        student's adapter (or none) is active again on leaving, its weights trainable."""
        if name in self.copies:
            yield self.copies[name]
            return
        trainable = [p for p in model.parameters() if p.requires_grad]
        try:
            if not self.policy_adapter:
                model.enable_adapters()
            model.set_adapter(TEACHER_PREFIX + name)
            yield model
        finally:
            if self.policy_adapter:
                model.set_adapter(POLICY_ADAPTER)
            else:
                model.disable_adapters()
            self.refreeze(trainable)

    def refreeze(self, trainable: list) -> None:
        """The teachers' weights frozen and the student's ``trainable`` ones trainable again (peft's adapter switches
        make the active adapter's trainable)."""
        for weight in self.frozen:
            weight.requires_grad_(False)
        for p in trainable:
            p.requires_grad_(True)

    def route(self, metadata: Sequence[dict]) -> list[list[int]]:
        """For each teacher (in ``names``' order), the positions of ``metadata``'s rows it scores."""
        if not self.route_key:
            return [list(range(len(metadata))) for _ in self.names]
        chosen = []
        for row in metadata:
            name = (row or {}).get(self.route_key)
            if name not in self.paths:
                raise ValueError(f"opd.route_key={self.route_key!r}: a prompt's metadata names the teacher {name!r}, "
                                 f"which is not one of opd.teachers {self.names} (metadata {row})")
            chosen.append(name)
        return [[i for i, name in enumerate(chosen) if name == teacher] for teacher in self.names]

    def step_kl(self, student_step, score: Callable, metadata: Sequence[dict], model) -> tuple[torch.Tensor, dict]:
        """The opd loss of N (sample, step) pairs [N] (gradient through ``student_step``) and each teacher's mean KL
        over the pairs it scored ({name: (sum, count)}). ``score(module, positions)`` gives the step output of the
        pairs at ``positions`` under a module; ``metadata``: each pair's row metadata; ``model``: the unwrapped
        student."""
        opd_kl = get_objective("opd")
        total = torch.zeros(len(metadata), device=student_step.mean.device)
        count = torch.zeros(len(metadata), device=student_step.mean.device)
        per_teacher = {}
        for name, positions in zip(self.names, self.route(metadata)):
            if not positions:
                continue
            index = torch.tensor(positions, device=total.device)
            with torch.no_grad(), self.applied(model, name) as teacher:
                teacher_step = score(teacher, index)
            kl = opd_kl(student_step.mean[index], teacher_step.mean, student_step.std[index], self.reduce)
            total = total.index_add(0, index, kl.float())
            count = count.index_add(0, index, torch.ones_like(kl, dtype=count.dtype))
            per_teacher[name] = (kl.detach().sum(), len(positions))
        return total / count.clamp(min=1), per_teacher

    def denoiser_copies(self) -> list:
        return list(self.copies.values())

    def state_dict(self) -> dict:
        """By reference: the teachers' paths (their weights are fingerprinted with the base model's)."""
        return {"paths": dict(self.paths), "route_key": self.route_key}

    def load_state_dict(self, state: dict) -> None:
        if dict(state["paths"]) != self.paths:
            raise ValueError(f"the checkpoint was distilled from the teachers {dict(state['paths'])}, this run names "
                             f"{self.paths} (opd.teachers): resume with the same teachers")
