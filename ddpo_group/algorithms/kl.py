"""Per-step KL to the reference model, and KL coefficient controllers.

Analytic Gaussian KL (kl_type "gaussian"). Policy and reference sampler steps are
Gaussians with the same std sigma_n, so per latent dimension
KL(N(mu_theta, s^2) || N(mu_ref, s^2)) = (mu_theta - mu_ref)^2 / (2 s^2), and

    KL_n = reduce_dims( (mu_theta - mu_ref)^2 ) / (2 sigma_n^2)

reduce_dims is the mean over latent dimensions by default (the same reduction as the log-prob,
ALGORITHMS.md), or the sum.

Log-prob estimators on d = l_theta(x_{n+1}) - l_ref(x_{n+1}) (x_{n+1} sampled from the
policy), as in LLM RL libraries:

    k1 ("kl")            d
    abs                  |d|
    k2 ("mse")           d^2 / 2
    k3 ("low_var_kl")    exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10]
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch


def gaussian_kl(mean_policy: torch.Tensor, mean_ref: torch.Tensor, std, reduce: str = "mean") -> torch.Tensor:
    """Analytic KL of two Gaussians sharing ``std``, reduced over all dims but the first.

    KL_i = reduce_{dims != 0}( (mean_policy - mean_ref)^2 / (2 std^2) ).

    Args:
        mean_policy, mean_ref: [N, ...] step means (N = samples or flattened (sample, step) pairs).
        std: a float, a 0-d tensor, a [N] tensor (one sigma per row), or any tensor whose
            shape is a prefix of the means' shape or broadcastable to it.
        reduce: "mean" (default, DDPO's convention) or "sum" over the latent dims.
    Returns:
        [N] tensor (float32 at least; computed in the means' dtype promoted to float32).
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    if mean_policy.shape != mean_ref.shape:
        raise ValueError(f"mean shapes differ: {tuple(mean_policy.shape)} vs {tuple(mean_ref.shape)}")
    dtype = torch.promote_types(mean_policy.dtype, torch.float32)
    diff = mean_policy.to(dtype) - mean_ref.to(dtype)
    std_t = torch.as_tensor(std, dtype=dtype, device=diff.device)
    if 0 < std_t.dim() < diff.dim() and tuple(std_t.shape) == tuple(diff.shape[: std_t.dim()]):
        std_t = std_t.reshape(tuple(std_t.shape) + (1,) * (diff.dim() - std_t.dim()))
    per_dim = diff.pow(2) / (2.0 * std_t.pow(2))
    per_dim = per_dim.expand_as(diff) if per_dim.shape != diff.shape else per_dim
    if diff.dim() <= 1:
        return per_dim
    dims = tuple(range(1, diff.dim()))
    return per_dim.mean(dim=dims) if reduce == "mean" else per_dim.sum(dim=dims)


KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Elementwise KL estimate from log-probs, d = log_prob - ref_log_prob (module docstring).

    kind: "k1"/"kl", "abs", "k2"/"mse", "k3"/"low_var_kl". ("gaussian" needs the step means
    and is computed by ``gaussian_kl``.)
    """
    d = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return 0.5 * d.pow(2)
    if kind in ("k3", "low_var_kl"):
        neg = torch.clamp(-d, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)
    if kind == "gaussian":
        raise ValueError("kind 'gaussian' needs the step means: use gaussian_kl(mean_policy, mean_ref, std)")
    raise ValueError(f"unknown KL kind {kind!r}; valid: {list(KL_KINDS)} (and 'gaussian' via gaussian_kl)")


class FixedKLController:
    """beta stays at ``value``; ``update`` is a no-op."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """PPO's adaptive KL coefficient (Ziegler et al. 2019), as in verl / trl.

        e     = clip(current_kl / target_kl - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    beta grows when the measured KL is above the target and shrinks when below.
    """

    def __init__(self, init_value: float, target_kl: float, horizon: float):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_value)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            return self.value
        err = float(np.clip(current_kl / self.target_kl - 1.0, -0.2, 0.2))
        self.value *= 1.0 + err * float(n_steps) / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target_kl = float(state.get("target_kl", self.target_kl))
        self.horizon = float(state.get("horizon", self.horizon))


def get_kl_controller(kind: str, value: float, target_kl: Optional[float] = None, horizon: Optional[float] = None):
    """Factory: kind "fixed" or "adaptive" (which needs target_kl and horizon)."""
    if kind == "fixed":
        return FixedKLController(value)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(value, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; valid: ['fixed', 'adaptive']")
