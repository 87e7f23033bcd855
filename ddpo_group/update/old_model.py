"""The old model of a matching objective that needs one (DiffusionNFT's v_old): a second set of denoiser weights that
lags the policy, samples the rollouts and gives v_old in the loss.

It is a reference model (reference/model.py) under another name: with LoRA a second adapter "old" on the same
denoiser (checkpointed with it), with full fine-tuning a frozen copy (checkpointed by this object). After each
epoch's update, with k the optimizer steps taken so far,

    theta_old <- d(k) theta_old + (1 - d(k)) theta,        d(k) = 0 for k < flat, else min((k - flat) * ramp, max)

DiffusionNFT's released schedules (its ``return_decay``): flat 0, ramp 0.001, max 0.5 (its default), and flat 75,
ramp 0.0075, max 0.999 (its OCR recipe). d = 0 makes the old model the policy itself after every epoch (on-policy).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ddpo_group.reference.model import ReferenceModel

OLD_ADAPTER = "old"


def old_decay(step: int, flat: int, ramp: float, maximum: float) -> float:
    """d(k) of the module docstring."""
    if step < flat:
        return 0.0
    return min((step - flat) * ramp, maximum)


class OldModel:
    def __init__(self, model, use_lora: bool, lora_config, flat: int, ramp: float, maximum: float):
        """``model``: the unwrapped policy denoiser, before accelerate wraps it."""
        mode = "adapter" if use_lora else "copy"
        self.weights = ReferenceModel(model, mode, alpha=1.0, update_freq=1, lora_config=lora_config,
                                      adapter_name=OLD_ADAPTER)
        self.flat, self.ramp, self.maximum = int(flat), float(ramp), float(maximum)
        self.last_decay = 0.0

    @classmethod
    def from_config(cls, config, model, lora_config=None) -> "OldModel":
        algorithm = config.algorithm
        return cls(model, config.use_lora, lora_config, algorithm.old_decay_flat_steps, algorithm.old_decay_ramp, algorithm.old_decay_max)

    @contextmanager
    def applied(self, model):
        """The module computing the old model's output (``model``: the unwrapped policy); use under no_grad."""
        with self.weights.applied(model) as old:
            yield old

    @torch.no_grad()
    def update(self, model, step: int) -> float:
        """theta_old <- d theta_old + (1 - d) theta after ``step`` optimizer steps; returns d."""
        self.last_decay = old_decay(step, self.flat, self.ramp, self.maximum)
        self.weights.mix(model, 1.0 - self.last_decay)
        return self.last_decay

    def metrics(self, model) -> dict:
        return {"old_decay": self.last_decay, "old_param_distance": self.weights.param_distance(model)}

    def state_dict(self) -> dict:
        return {"last_decay": self.last_decay, **self.weights.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.last_decay = float(state["last_decay"])
        self.weights.load_state_dict({k: v for k, v in state.items() if k != "last_decay"})
