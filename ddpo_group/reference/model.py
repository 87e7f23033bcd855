"""The reference model of the KL term: frozen, or updated by mixup every few epochs (ALGORITHMS.md).

Three forms, chosen from ``use_lora`` and ``kl.reference_update_freq`` F:

* ``base`` (LoRA, F = 0): the base denoiser, i.e. the policy with its adapters disabled
  (``model.disable_adapters()`` / ``enable_adapters()``). No extra memory.
* ``adapter`` (LoRA, F > 0): a second LoRA adapter named "reference" on the same denoiser
  (``model.add_adapter(config, adapter_name="reference")``), initialised to the policy's adapter
  and activated with ``model.set_adapter`` for the reference forward. Its weights live in the
  denoiser's state dict, so they are checkpointed with the model.
* ``copy`` (full fine-tuning): a frozen deep copy of the denoiser (its weights are part of this
  object's ``state_dict`` for checkpoints when it is updated).

Update every F epochs (after epochs F-1, 2F-1, ...):

    theta_ref <- alpha * theta_policy + (1 - alpha) * theta_ref        (alpha = 1: hard sync)

``param_distance`` is the Frobenius distance between the policy's and the reference's effective
denoiser weights: sqrt(sum over LoRA layers ||s (B_p A_p - B_r A_r)||^2) for adapters (B_r A_r = 0
for ``base``), sqrt(sum ||theta_p - theta_r||^2) for ``copy``.
"""

from __future__ import annotations

import copy
import math
import warnings
from contextlib import contextmanager

import torch

POLICY_ADAPTER = "default"
REFERENCE_ADAPTER = "reference"
TEACHER_PREFIX = "teacher_"  # an on-policy distillation teacher's adapter: teacher_<its name> (teachers.py)


def lora_layers(model, adapter: str | None = None):
    """The peft LoRA layers of ``model`` (holding ``adapter``, when named: a teacher's export may hold layers the
    policy's adapter has not, as Wan's with the image-to-video keys diffusers adds)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer) and (adapter is None or adapter in m.lora_A)]


def own_parameters(model) -> list:
    """``model``'s parameters but the distillation teachers' adapters, in order: what a frozen copy made before the
    teachers were loaded pairs with, one to one."""
    return [p for name, p in model.named_parameters() if f".{TEACHER_PREFIX}" not in name]


class ReferenceModel:
    def __init__(self, model, mode: str, alpha: float = 1.0, update_freq: int = 0, lora_config=None,
                 adapter_name: str = REFERENCE_ADAPTER):
        """``model`` is the unwrapped policy denoiser (UNet or transformer); build before ``accelerator.prepare``.
        ``adapter_name``: the second adapter's name in ``adapter`` mode (the matching objectives' old model is one
        more such model, update/old_model.py)."""
        if mode not in ("base", "adapter", "copy"):
            raise ValueError(f"reference mode must be 'base', 'adapter' or 'copy', got {mode!r}")
        self.mode = mode
        self.adapter_name = adapter_name
        self.alpha = float(alpha)
        self.update_freq = int(update_freq)
        self.last_update_epoch = -1
        self.copy = None
        if mode == "adapter":
            if lora_config is None:
                raise ValueError("the 'adapter' reference needs the policy's LoraConfig")
            trainable = [p for p in model.parameters() if p.requires_grad]
            with warnings.catch_warnings():  # peft warns that a second adapter is added: that is the point
                warnings.filterwarnings("ignore", message=".*multiple adapters.*")
                model.add_adapter(copy.deepcopy(lora_config), adapter_name=self.adapter_name)  # activates it
            model.set_adapter(POLICY_ADAPTER)
            for p in trainable:
                p.requires_grad_(True)
            for layer in lora_layers(model, POLICY_ADAPTER):
                for name in ("lora_A", "lora_B"):
                    ref = getattr(layer, name)[self.adapter_name]
                    ref.to(dtype=getattr(layer, name)[POLICY_ADAPTER].weight.dtype)
                    ref.requires_grad_(False)
            self.mix(model, 1.0)
        elif mode == "copy":
            self.copy = copy.deepcopy(model).requires_grad_(False).eval()

    @classmethod
    def from_config(cls, config, model, lora_config=None) -> "ReferenceModel | None":
        kl = config.kl
        if not kl.use_reference_model:
            return None
        if config.use_lora:  # an adapter when it follows the policy: every reference_update_freq epochs, or once from
            # the supervised epochs' fine-tuned policy (sft.epochs, run/trainer.py)
            mode = "adapter" if kl.reference_update_freq > 0 or config.sft.epochs > 0 else "base"
        else:
            mode = "copy"
        return cls(model, mode, kl.reference_mixup_alpha, kl.reference_update_freq, lora_config)

    # ------------------------------------------------------------------ forward
    @contextmanager
    def applied(self, model):
        """Context yielding the module that computes the reference's output; ``model`` is the unwrapped policy.

        Use under ``torch.no_grad()``. peft's adapter switches toggle ``requires_grad``; leaving the
        context restores the policy adapter as the active, trainable one.
        """
        if self.mode == "copy":
            yield self.copy
            return
        trainable = [p for p in model.parameters() if p.requires_grad]
        try:
            if self.mode == "base":
                model.disable_adapters()
            else:
                model.set_adapter(self.adapter_name)
            yield model
        finally:
            if self.mode == "base":
                model.enable_adapters()
            else:
                model.set_adapter(POLICY_ADAPTER)
            for p in trainable:
                p.requires_grad_(True)

    # ------------------------------------------------------------------ updates
    def due(self, epoch: int) -> bool:
        return self.update_freq > 0 and (epoch + 1) % self.update_freq == 0

    @torch.no_grad()
    def maybe_update(self, model, epoch: int) -> bool:
        """Mix the policy into the reference after ``epoch`` when an update is due; True if it was."""
        if not self.due(epoch):
            return False
        self.mix(model, self.alpha)
        self.last_update_epoch = epoch
        return True

    @torch.no_grad()
    def mix(self, model, alpha: float) -> None:
        """theta_ref <- alpha theta + (1 - alpha) theta_ref from the policy ``model`` (the adapter or the copy; the
        base with its adapters off follows nothing)."""
        if self.mode == "adapter":
            for layer in lora_layers(model, POLICY_ADAPTER):
                for name in ("lora_A", "lora_B"):
                    adapters = getattr(layer, name)
                    adapters[self.adapter_name].weight.lerp_(adapters[POLICY_ADAPTER].weight.to(adapters[self.adapter_name].weight.dtype), alpha)
        elif self.mode == "copy":
            for ref, pol in zip(self.copy.parameters(), own_parameters(model)):
                ref.lerp_(pol.detach().to(ref.dtype), alpha)

    @torch.no_grad()
    def param_distance(self, model) -> float:
        total = 0.0
        if self.mode == "copy":
            for ref, pol in zip(self.copy.parameters(), own_parameters(model)):
                total += float((pol.detach().double() - ref.double()).pow(2).sum())
            return math.sqrt(total)
        for layer in lora_layers(model, POLICY_ADAPTER):
            scale = layer.scaling[POLICY_ADAPTER]
            a, b = layer.lora_A[POLICY_ADAPTER].weight, layer.lora_B[POLICY_ADAPTER].weight
            delta = scale * (b.double().flatten(1) @ a.double().flatten(1))
            if self.mode == "adapter":
                ra, rb = layer.lora_A[self.adapter_name].weight, layer.lora_B[self.adapter_name].weight
                delta = delta - layer.scaling[self.adapter_name] * (rb.double().flatten(1) @ ra.double().flatten(1))
            total += float(delta.pow(2).sum())
        return math.sqrt(total)

    def adapter_weights(self, model) -> list[torch.Tensor]:
        """An ``adapter`` reference's LoRA matrices in ``model`` (the unwrapped policy; the denoiser's state holds
        them, not this object's); [] in the other modes."""
        if self.mode != "adapter":
            return []
        return [getattr(layer, name)[self.adapter_name].weight
                for layer in lora_layers(model, POLICY_ADAPTER) for name in ("lora_A", "lora_B")]

    def metrics(self, model) -> dict:
        return {"ref/last_update_epoch": float(self.last_update_epoch), "ref/param_distance": self.param_distance(model)}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        state = {"last_update_epoch": self.last_update_epoch}
        if self.mode == "copy" and self.update_freq > 0:  # a frozen copy is rebuilt from the base weights
            state["copy"] = self.copy.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.last_update_epoch = int(state["last_update_epoch"])
        if "copy" in state and self.copy is not None:
            self.copy.load_state_dict(state["copy"])
