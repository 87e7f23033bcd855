"""Whether the update is on-policy: before its first optimizer step the training forward scores the rollout policy's
own transitions, so every ratio exp(l_theta - l_old) is 1 up to float rounding. A larger |ratio - 1| means the
training forward does not reproduce the sampler (guidance, precision, timesteps, a compiled or chunked forward, a
family's quirk): PPO's clipping then acts on that error, not on the policy's change.

    train/ratio_before_update = max |exp(l_theta - l_old) - 1| over the pairs trained before the epoch's first
                                optimizer step (every process)

``RATIO_TOLERANCE`` is what each precision's rounding allows (float32: the CPU measured 2e-6 between chunk sizes,
bf16 exactly 0; a GPU's kernels depend on the batch size); ``scripts/check.py`` finds the cause of a larger one.
"""

from __future__ import annotations

import torch

RATIO_TOLERANCE = {"no": 1e-4, "fp16": 1e-3, "bf16": 5e-3}  # by mixed_precision
CHECK_COMMAND = "python scripts/check.py --config config/base.py:PRESET (with this run's --config.* settings)"


def ratio_tolerance(mixed_precision: str) -> float:
    return RATIO_TOLERANCE[mixed_precision]


def ratio_deviation(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """|exp(l_theta - l_old) - 1| of each pair, in float32 (the update's train/ratio_before_update and the pre-flight
    check's per-step columns both read it)."""
    return (torch.exp(log_prob.float() - old_log_prob.float()) - 1).abs()


class OnPolicyWatch:
    """Warns once, naming the check script, when an epoch's ratio before its update exceeds the tolerance."""

    def __init__(self, mixed_precision: str, say=print):
        self.tolerance, self.say, self.warned = ratio_tolerance(mixed_precision), say, False

    def __call__(self, ratio_before_update: float | None) -> None:
        if self.warned or ratio_before_update is None or not ratio_before_update > self.tolerance:
            return
        self.warned = True
        self.say(f"warning: train/ratio_before_update={ratio_before_update:.3g} is above the on-policy tolerance "
                 f"{self.tolerance:g} of this precision: the training forward does not reproduce the sampler's "
                 f"log-probabilities, so the update is off-policy from its first step. Find the cause with {CHECK_COMMAND}")
