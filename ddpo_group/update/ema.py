"""An exponential moving average (EMA) of the trainable weights, as Flow-GRPO's ``EMAModuleWrapper``.

The EMA starts as a copy of the trainable weights before the first update. After the k-th optimizer step of the run
(k = 1, 2, ...: the run's global step once that step is taken, which is what Flow-GRPO's training scripts pass as
``optimization_step``):

    if (k + 1) % interval == 0:
        decay_k = min((1 + k) / (10 + k), decay)          (warm-up: early updates follow the weights closely)
        ema    <- ema + (1 - decay_k) * (theta - ema)

Flow-GRPO's defaults: decay 0.9, interval 8 (the first update is at k = 7 with decay_k = 8/17; decay_k reaches 0.9
at k = 80). The update is computed as Flow-GRPO computes it, ``ema.add_((1 - decay_k) * (theta - ema))`` in the
weights' dtype (float32 trainable weights). One difference: Flow-GRPO's original script calls its ``step`` once per
train batch, so with gradient accumulation an update can repeat at the same k; here it runs once per optimizer step.

The EMA holds its own count of optimizer steps and its tensors; both are checkpointed (``state_dict``), so a resumed
run continues the same average bitwise. ``swapped_in()`` puts the EMA into the model for a while (evaluation, the LoRA
export) and restores the training weights bitwise afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from ddpo_group.errors import ConfigError


def ema_decay(step: int, decay: float) -> float:
    """Flow-GRPO's warmed-up decay at optimizer step ``step``: min((1 + step) / (10 + step), decay)."""
    return min((1 + step) / (10 + step), decay)


class EMAWeights:
    """The EMA of ``params`` (module docstring). ``step()`` after every optimizer step."""

    def __init__(self, params, decay: float = 0.9, interval: int = 8):
        self.params = list(params)
        self.decay = float(decay)
        self.interval = int(interval)
        self.shadow = [p.detach().clone() for p in self.params]
        self.steps = 0  # optimizer steps seen (k of the module docstring after the last one)
        self.updates = 0  # EMA updates applied
        self.last_decay = float("nan")  # decay_k of the last update

    @classmethod
    def from_config(cls, config, params) -> "EMAWeights | None":
        train = config.train
        if not train.ema:
            return None
        return cls(params, train.ema_decay, train.ema_update_interval)

    @torch.no_grad()
    def step(self) -> None:
        """Count one optimizer step; every ``interval``-th one (by Flow-GRPO's rule) moves the EMA toward the weights."""
        self.steps += 1
        k = self.steps
        if (k + 1) % self.interval != 0:
            return
        decay = ema_decay(k, self.decay)
        one_minus_decay = 1 - decay
        for ema, param in zip(self.shadow, self.params, strict=True):
            ema.add_(one_minus_decay * (param.detach() - ema))
        self.updates += 1
        self.last_decay = decay

    def swapped_in(self):
        """The EMA weights in the model inside the block; the training weights, bitwise, after it (also on error)."""
        return swapped_in(self.params, self.shadow)

    @torch.no_grad()
    def metrics(self) -> dict:
        """ema/updates, ema/decay (of the last update; NaN before the first) and ema/param_distance ||theta - ema||_F."""
        distance = sum(float((p.detach().float() - e.float()).pow(2).sum()) for p, e in zip(self.params, self.shadow))
        return {"ema/updates": self.updates, "ema/decay": self.last_decay, "ema/param_distance": distance ** 0.5}

    def state_dict(self) -> dict:
        return {"shadow": [t.detach().cpu() for t in self.shadow], "steps": self.steps, "updates": self.updates,
                "last_decay": self.last_decay}

    def load_state_dict(self, state: dict) -> None:
        load_weight_copies(self.shadow, state["shadow"], "EMA")
        self.steps, self.updates = int(state["steps"]), int(state["updates"])
        self.last_decay = float(state.get("last_decay", float("nan")))


def held_weights(ema: EMAWeights | None, use_ema: bool):
    """The context in which the model holds the weights to evaluate or export: the EMA's when the run has one and
    ``use_ema`` (train.ema_eval, train.ema_export), else the training weights as they are."""
    return ema.swapped_in if ema is not None and use_ema else nullcontext


@contextmanager
def swapped_in(params: list[torch.Tensor], copies: list[torch.Tensor]):
    """``copies`` of the trainable weights (the EMA's, the restore point's) in ``params`` inside the block; the weights
    they held, bitwise, after it (also on error)."""
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        for param, copy in zip(params, copies, strict=True):
            param.copy_(copy)
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(params, saved, strict=True):
                param.copy_(value)


def load_weight_copies(copies: list[torch.Tensor], saved: list[torch.Tensor], what: str) -> None:
    """A checkpoint's copies of the trainable weights (``what``: the EMA, the restore point) into ``copies``, in place,
    once their shapes are those of this config's trainable weights."""
    shapes = [tuple(t.shape) for t in copies]
    if [tuple(t.shape) for t in saved] != shapes:
        raise ConfigError(f"the checkpoint's {what} holds {len(saved)} tensors of other shapes than the "
                          f"{len(shapes)} trainable weights of this config (use_lora, lora_rank?)")
    with torch.no_grad():
        for copy, value in zip(copies, saved):
            copy.copy_(value)
