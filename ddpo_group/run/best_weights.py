"""The best evaluation's weights, held in one place: on disk (lora_best/ with LoRA, else best/, with best.json) and in
memory (the restore point), which the guard's restore loads back into the policy when the fall or held-out rule finds
the run below that best (run/guard.py decides which evaluation is the best and when to restore), and which the fresh
final evaluation scores (run/fresh_evaluation.py).

The restore point is a CPU copy of the trainable weights in their own dtype (a LoRA adapter: megabytes; full
fine-tuning: the trained weights once more), one per process (each its shard under FSDP), and checkpointed, so a
resumed run restores what an uninterrupted one would. With ``guard.on_alarm="restore"`` it also holds everything else
the run had learned at that evaluation (the trainer's ``learned_state``: the policy's optimizer, the stat tracker,
each component's ``learned_state``: the critic and its optimizer, the estimator's controller, the KL term's gates and
a reference that follows the policy, the EMA, the old model), so a restore returns the whole run to that evaluation;
only the counters and the prompt stream go on. ``keep`` runs inside the context that holds the evaluated weights (the
EMA's when the evaluation samples with them): what is kept is what was evaluated. Each restore (after which
evaluation, to which) is listed in best.json and in this object's state.
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
from ddpo_group.update.ema import load_weight_copies, swapped_in


@register_component("best_weights")
class BestWeights(Component):
    """The best evaluation's weights (module docstring). ``holds``: keep the restore point in memory (the guard's
    restore, the fresh final evaluation); ``restores``: with the run's learned state (``learned()`` returns it,
    ``relearn(state)`` puts it back: the trainer's). The run's evaluations make it (run/evaluations.py)."""

    @classmethod
    def build(cls, parts):
        return parts.best_weights

    def __init__(self, config, accelerator, model, family, params, session, timer, holds: bool, restores: bool,
                 learned=dict, relearn=None):
        self.config, self.accelerator, self.model, self.family, self.timer = config, accelerator, model, family, timer
        self.session = session  # its run directory, agreed on by the processes when the run starts
        self.stateful = holds  # the restore point is checkpointed
        self.restores_learned, self.learned, self.relearn = restores, learned, relearn
        self.params = list(params)
        self.copy = [p.detach().to("cpu", copy=True) for p in self.params] if holds else []
        self.learned_copy: dict = {}  # the run's learned state at that evaluation (``restores``)
        self.epoch: int | None = None  # the evaluation the restore point holds (-1: before training); None: none yet
        self.record: dict = {}  # best.json's
        self.restores: list[dict] = []  # {"after_epoch", "to_epoch"} of each restore, in order

    # a checkpoint written when only the guard's restore kept it: no best weights until the next best evaluation
    missing_ok = True

    def learned_state(self):
        return None  # the restore point itself

    @property
    def path(self) -> Path:
        return Path(self.session.run_dir) / (BEST_LORA if self.config.use_lora else BEST_WEIGHTS)

    def keep(self, epoch: int, measure: str, scores: dict, weights=nullcontext) -> Path:
        """The weights of evaluation ``epoch``, the best so far by ``measure``, inside ``weights()``: written to
        lora_best/ (diffusers format) or best/ (the trained weights, model.safetensors, as scripts/evaluate.py loads
        them), each with best.json naming the evaluation and its ``scores`` ("score", the one reported, and where it
        was selected and reported), beside and then moved in (an interruption leaves the previous best whole); and
        into the restore point."""
        self.record = {"epoch": epoch, "measure": measure, **scores}
        with self.timer.phase("checkpoint"):
            self.write(weights)
        if self.stateful:
            with weights(), torch.no_grad():
                for saved, param in zip(self.copy, self.params, strict=True):
                    saved.copy_(param.detach())
            self.learned_copy = self.learned() if self.restores_learned else {}
            self.epoch = epoch
        return self.path

    def write(self, weights) -> None:
        """The weights inside ``weights()`` and best.json (``self.record``, with the restores so far) to lora_best/ or
        best/, beside and then moved in."""
        config, accelerator, target, state = self.config, self.accelerator, self.path, None
        epoch = self.record["epoch"]
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
                self.write_record(partial)
                shutil.rmtree(target, ignore_errors=True)
                os.replace(partial, target)
        accelerator.wait_for_everyone()

    def write_record(self, directory: Path) -> None:
        """best.json in ``directory``: the evaluation, its scores and the run's restores so far (written beside, then
        moved in)."""
        partial = directory / (BEST_RECORD + ".tmp")
        with writing(partial, f"{directory / BEST_RECORD}"):
            partial.write_text(json.dumps({**self.record, "restores": self.restores}) + "\n")
            os.replace(partial, directory / BEST_RECORD)

    @torch.no_grad()
    def restore(self, after_epoch: int) -> int:
        """The restore point back into the policy, bitwise, and the run's learned state at its evaluation (after the
        evaluation of epoch ``after_epoch``); listed in best.json; returns the epoch of the restored evaluation."""
        if self.epoch is None:
            raise RuntimeError("no evaluation's weights were kept to restore (the guard restores after an evaluation)")
        for param, saved in zip(self.params, self.copy, strict=True):
            param.copy_(saved)
        self.relearn(self.learned_copy)
        self.restores.append({"after_epoch": int(after_epoch), "to_epoch": int(self.epoch)})
        if self.accelerator.is_main_process and self.path.is_dir():
            self.write_record(self.path)
        return self.epoch

    def swapped_in(self):
        """The restore point's weights in the policy inside the block; the policy's own, bitwise, after it."""
        return swapped_in(self.params, self.copy)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "copy": self.copy, "learned": self.learned_copy, "restores": self.restores,
                "record": self.record}

    def load_state_dict(self, state: dict) -> None:
        load_weight_copies(self.copy, state["copy"], "restore point")
        self.epoch = None if state["epoch"] is None else int(state["epoch"])
        self.learned_copy = state.get("learned", {})  # a checkpoint written before: the weights only
        self.restores = [dict(r) for r in state.get("restores", [])]
        self.record = dict(state.get("record", {}))
