"""Whether the update is on-policy: before its first optimizer step the training forward scores the rollout policy's
own transitions, so every ratio exp(l_theta - l_rollout) is 1 up to float rounding. A larger |ratio - 1| means the
training forward does not reproduce the sampler (guidance, precision, timesteps, a compiled or chunked forward, a
family's quirk, a random layer in training mode). The yardstick is what the policy loss does with it: PPO's clipping
acts on a ratio outside [1 - clip_range, 1 + clip_range] (train.clip_range, 1e-4 by default), and when it acts on
rounding instead of on the policy's change the first update is not the one the algorithm describes.

    train/ratio_before_update    = max |exp(l_theta - l_rollout) - 1| over the pairs trained before the epoch's first
                                   optimizer step (every process)
    train/clipped_before_update  = the share of those pairs outside the loss's trust region (a ratio-clipping loss:
                                   outside its clip range; dppo: the pairs its mask blocks; another loss, its own
                                   bound: policy_losses.py)

A run warns once when either passes its bound: the precision's rounding (``RATIO_TOLERANCE``; float32: the CPU
measured 2e-6 between chunk sizes, bf16 exactly 0; a GPU's kernels depend on the batch size) or more than
``CLIPPED_SHARE`` of the pairs clipped before any update. ``scripts/check.py`` finds the cause and what removes it.
"""

from __future__ import annotations

import torch

RATIO_TOLERANCE = {"no": 1e-4, "fp16": 1e-3, "bf16": 5e-3}  # by mixed_precision
CLIPPED_SHARE = 0.01  # of the pairs before any update, at most: beyond it the trust region acts on numerics
CHECK_COMMAND = "python scripts/check.py --config config/base.py:PRESET (with this run's --config.* settings)"


def ratio_tolerance(mixed_precision: str) -> float:
    return RATIO_TOLERANCE[mixed_precision]


def ratio_deviation(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> torch.Tensor:
    """|exp(l_theta - l_rollout) - 1| of each pair, in float32 or the log-probs' wider dtype (sample.log_prob_dtype) (the
    update's train/ratio_before_update and the pre-flight check's per-step columns both read it)."""
    dtype = torch.promote_types(torch.promote_types(log_prob.dtype, rollout_log_prob.dtype), torch.float32)
    return (torch.exp(log_prob.to(dtype) - rollout_log_prob.to(dtype)) - 1).abs()


class OnPolicyWatch:
    """Warns once, naming the check script, when an epoch's ratio before its update exceeds the precision's tolerance
    or the loss's trust region acts on more than CLIPPED_SHARE of the pairs before any update."""

    def __init__(self, mixed_precision: str, trust_region: str, say=print):
        """``trust_region``: the fields that set the loss's bounds (PolicyLossSpec.trust_region_fields)."""
        self.tolerance, self.trust_region = ratio_tolerance(mixed_precision), trust_region
        self.say, self.warned = say, False

    def __call__(self, ratio_before_update: float | None, clipped_before_update: float | None = None) -> None:
        if self.warned or ratio_before_update is None:
            return
        reasons = []
        if ratio_before_update > self.tolerance:
            reasons.append(f"train/ratio_before_update={ratio_before_update:.3g} is above the on-policy tolerance "
                           f"{self.tolerance:g} of this precision")
        if clipped_before_update is not None and clipped_before_update > CLIPPED_SHARE:
            reasons.append(f"train/clipped_before_update={clipped_before_update:.3g}: the policy loss's trust region "
                           f"({self.trust_region}) acts on more than {CLIPPED_SHARE:.0%} of the "
                           "pairs before any update, on rounding instead of on the policy's change")
        if not reasons:
            return
        self.warned = True
        self.say(f"warning: {'; '.join(reasons)}: the training forward does not reproduce the sampler's "
                 f"log-probabilities closely enough, so the update is off-policy from its first step. Find the cause "
                 f"and what removes it with {CHECK_COMMAND}, or recompute the rollout's log-probabilities with the "
                 "training forward (train.recompute_rollout=True)")
