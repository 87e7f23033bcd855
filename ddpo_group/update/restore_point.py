"""The restore point: a copy of the trainable weights at the guard's best evaluation, which ``guard.on_alarm="restore"``
loads back into the policy when the fall or held-out rule finds the run below that best (run/guard.py).

The copy is on the CPU, in the weights' own dtype (a LoRA adapter: megabytes; full fine-tuning: the trained weights
once more), one per process (each its shard under FSDP), and checkpointed, so a resumed run restores what an
uninterrupted one would. ``keep`` is called inside the context that holds the evaluated weights (the EMA's when the
evaluation samples with them), so the copy is what was evaluated.
"""

from __future__ import annotations

import torch

from ddpo_group.update.ema import load_weight_copies


class RestorePoint:
    def __init__(self, params):
        self.params = list(params)
        self.copy = [p.detach().to("cpu", copy=True) for p in self.params]
        self.epoch: int | None = None  # the evaluation the copy holds (-1: before training); None: none kept yet

    @torch.no_grad()
    def keep(self, epoch: int) -> None:
        """The weights in the model now are evaluation ``epoch``'s, the best so far."""
        for saved, param in zip(self.copy, self.params, strict=True):
            saved.copy_(param.detach())
        self.epoch = epoch

    @torch.no_grad()
    def restore(self) -> int:
        """The kept weights back into the model, bitwise; returns the epoch of their evaluation."""
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
