"""Rollout correction: the policy-gradient loss's per-pair factor when the sampler that drew the rollouts (another
engine, another precision) is not the training forward at the same weights (verl's ``algorithm.rollout_correction``,
decoupled mode; "When Speed Kills Stability", Liu, Li et al. 2025).

For the trainable (trajectory i, step n) pairs of an epoch (mask M), with l_rollout the log-probability the sampler
recorded and l_old the training forward's at the weights that sampled (update/policy_update.py recomputes it first and
the loss's ratio then starts from it):

    (1) delta_{i,n}  = l_old(i, n) - l_rollout(i, n)                 the log-ratio pi_old / pi_rollout of a step
    (2) log rho      = delta_{i,n}                                   level "step" (verl's "token")
                     = sum_n M_{i,n} delta_{i,n}, on each step of i   level "trajectory" (verl's "sequence")
                       clamped to [-20, 20] (a bound against overflow, verl's)
    (3) w_is         = min(rho_is, is_threshold)                     truncated importance weight (TIS); 1 without
    (4) keep         = rs_threshold_lower <= rho_rs <= rs_threshold  rejection by a band (lower 0: 1 / rs_threshold);
                                                                     every pair kept without
    (5) factor       = w_is * keep                                   multiplies each pair's loss weight

The step's log-probability is this project's (a mean over latent dimensions with sample.log_prob_reduce="mean"), so
its ratios are that mean's, as the policy loss's are; a trajectory's log-ratio sums its trainable steps'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = ("", "step", "trajectory")  # "": off
LOG_RATIO_BOUND = 20.0  # (2)'s clamp


@dataclass
class Correction:
    """The factor (5) of every pair [B, T] (0 outside the mask) and its measures over the masked pairs."""

    factor: torch.Tensor
    metrics: dict  # rollout_log_ratio_abs, rollout_is_weight_mean / _std, rollout_is_truncated, rollout_rs_masked


def log_ratio(delta: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(2): the log-ratio each pair is weighed or rejected by, at ``level``, [B, T]."""
    delta = torch.where(mask, delta, 0.0)
    if level == "trajectory":
        delta = delta.sum(dim=1, keepdim=True).expand_as(delta)
    return delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def rollout_correction(rollout_log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor, config
                       ) -> Correction:
    """The correction (module docstring) of pairs [B, T] whose ``mask`` is True; ``config``: the config's
    algorithm.rollout_correction (is_level, is_threshold, rs_level, rs_threshold, rs_threshold_lower)."""
    mask = mask.bool()
    delta = (old_log_prob.double() - rollout_log_prob.double())  # (1), in float64: a mean log-prob's 1e-7 differences
    weight = torch.ones_like(delta)
    truncated = torch.zeros_like(mask)
    if config.is_level:
        rho = log_ratio(delta, mask, config.is_level).exp()
        truncated = (rho > config.is_threshold) & mask
        weight = rho.clamp(max=config.is_threshold)  # (3)
    keep = torch.ones_like(mask)
    if config.rs_level:
        upper = float(config.rs_threshold)
        lower = float(config.rs_threshold_lower) or 1.0 / upper
        rho = log_ratio(delta, mask, config.rs_level).exp()
        keep = (rho >= lower) & (rho <= upper)  # (4)
    factor = torch.where(mask & keep, weight, 0.0)  # (5)
    pairs = mask.sum().clamp(min=1)
    kept = weight[mask]
    metrics = {"rollout_log_ratio_abs": float(delta[mask].abs().sum() / pairs),
               "rollout_is_weight_mean": float(kept.mean()) if kept.numel() else 1.0,
               "rollout_is_weight_std": float(kept.std()) if kept.numel() > 1 else 0.0,
               "rollout_is_truncated": float(truncated.sum() / pairs),
               "rollout_rs_masked": float((mask & ~keep).sum() / pairs)}
    return Correction(factor.to(rollout_log_prob.dtype), metrics)


def correction_errors(config) -> list[str]:
    """What is wrong with algorithm.rollout_correction (each naming the value and what is allowed)."""
    rc, errors = config.algorithm.rollout_correction, []
    for name in ("is_level", "rs_level"):
        if rc[name] not in LEVELS:
            errors.append(f"algorithm.rollout_correction.{name}={rc[name]!r} must be one of {LEVELS} (\"\": off)")
    if rc.is_level and not rc.is_threshold > 0:
        errors.append(f"algorithm.rollout_correction.is_threshold={rc.is_threshold} must be > 0 (the weights' cap)")
    if rc.rs_level:
        if not rc.rs_threshold > 1:
            errors.append(f"algorithm.rollout_correction.rs_threshold={rc.rs_threshold} must be > 1 (the band's upper "
                          "ratio)")
        elif not 0 <= rc.rs_threshold_lower < 1:
            errors.append(f"algorithm.rollout_correction.rs_threshold_lower={rc.rs_threshold_lower} must be in "
                          "[0, 1) (the band's lower ratio; 0: 1 / rs_threshold)")
    return errors
