"""The best evaluation's weights, held in one place: on disk (lora_best/ with LoRA, else best/, with best.json) and,
with ``guard.on_alarm="restore"``, in memory (the restore point), which the guard's restore loads back into the
policy when the fall or held-out rule finds the run below that best (run/guard.py decides which evaluation is the
best and when to restore).

The restore point is a CPU copy of the trainable weights in their own dtype (a LoRA adapter: megabytes; full
fine-tuning: the trained weights once more), one per process (each its shard under FSDP), and checkpointed, so a
resumed run restores what an uninterrupted one would. ``keep`` runs inside the context that holds the evaluated
weights (the EMA's when the evaluation samples with them): what is kept is what was evaluated.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import nullcontext
from pathlib import Path

import torch

from ddpo_group.rollout.component import Component
from ddpo_group.run.components import register_component
from ddpo_group.run.persistence.checkpointing import BEST_LORA, BEST_RECORD, BEST_WEIGHTS, trained_weights
from ddpo_group.run.persistence.write_errors import writing
from ddpo_group.update.ema import load_weight_copies


@register_component("best_weights")
class BestWeights(Component):
    """The best evaluation's weights (module docstring). ``restores``: keep the restore point in memory too. The
    run's evaluations make it (run/evaluations.py); the last component."""

    @classmethod
    def build(cls, parts):
        return parts.best_weights

    def __init__(self, config, accelerator, model, family, params, session, timer, restores: bool):
        self.config, self.accelerator, self.model, self.family, self.timer = config, accelerator, model, family, timer
        self.session = session  # its run directory, agreed on by the processes when the run starts
        self.stateful = restores  # the restore point is checkpointed
        self.params = list(params)
        self.copy = [p.detach().to("cpu", copy=True) for p in self.params] if restores else []
        self.epoch: int | None = None  # the evaluation the restore point holds (-1: before training); None: none yet

    @property
    def path(self) -> Path:
        return Path(self.session.run_dir) / (BEST_LORA if self.config.use_lora else BEST_WEIGHTS)

    def keep(self, epoch: int, measure: str, scores: dict, weights=nullcontext) -> Path:
        """The weights of evaluation ``epoch``, the best so far by ``measure``, inside ``weights()``: written to
        lora_best/ (diffusers format) or best/ (the trained weights, model.safetensors, as scripts/evaluate.py loads
        them), each with best.json naming the evaluation and its ``scores`` ("score", the one reported, and where it
        was selected and reported), beside and then moved in (an interruption leaves the previous best whole); and
        into the restore point."""
        with self.timer.phase("checkpoint"):
            self.write(epoch, measure, scores, weights)
        if self.stateful:
            with weights(), torch.no_grad():
                for saved, param in zip(self.copy, self.params, strict=True):
                    saved.copy_(param.detach())
            self.epoch = epoch
        return self.path

    def write(self, epoch: int, measure: str, scores: dict, weights) -> None:
        config, accelerator, target, state = self.config, self.accelerator, self.path, None
        if not config.use_lora:  # every process (FSDP gathers the full weights on the main process)
            with weights():
                state = accelerator.get_state_dict(self.model)
        if accelerator.is_main_process:
            partial = target.with_name(target.name + ".tmp")
            shutil.rmtree(partial, ignore_errors=True)
            with writing(partial, f"the weights of the best evaluation (epoch {epoch})"):
                if config.use_lora:
                    with weights():
                        self.family.save_lora(self.model, partial)
                else:
                    from safetensors.torch import save_file

                    kept = trained_weights(accelerator.unwrap_model(self.model))
                    partial.mkdir(parents=True)
                    save_file({k: v.detach().cpu().contiguous() for k, v in state.items() if k in kept},
                              str(partial / "model.safetensors"))
                record = {"epoch": epoch, "measure": measure, **scores}
                (partial / BEST_RECORD).write_text(json.dumps(record) + "\n")
                shutil.rmtree(target, ignore_errors=True)
                os.replace(partial, target)
        accelerator.wait_for_everyone()

    @torch.no_grad()
    def restore(self) -> int:
        """The restore point back into the policy, bitwise; returns the epoch of its evaluation."""
        if self.epoch is None:
            raise RuntimeError("no evaluation's weights were kept to restore (the guard restores after an evaluation)")
        for param, saved in zip(self.params, self.copy, strict=True):
            param.copy_(saved)
        return self.epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "copy": self.copy}

    def load_state_dict(self, state: dict) -> None:
        load_weight_copies(self.copy, state["copy"], "restore point")
        self.epoch = None if state["epoch"] is None else int(state["epoch"])
