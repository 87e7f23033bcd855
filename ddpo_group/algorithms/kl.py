"""Per-step KL to the reference model (a registry of KL kinds), and KL coefficient controllers.

A KL kind maps the policy's and the reference's step outputs on the same transitions (objects with
``log_prob`` [N], ``mean`` [N, ...] and ``std`` [N], e.g. DDIMStepOutput) to KL_n [N]::

    @register_kl_kind("gaussian")
    def gaussian_step_kl(policy, reference, reduce="mean") -> torch.Tensor

Analytic Gaussian KL ("gaussian", the default). Policy and reference sampler steps are
Gaussians with the same std sigma_n, so per latent dimension
KL(N(mu_theta, s^2) || N(mu_ref, s^2)) = (mu_theta - mu_ref)^2 / (2 s^2), and

    KL_n = reduce_dims( (mu_theta - mu_ref)^2 ) / (2 sigma_n^2)

reduce_dims is the mean over latent dimensions by default (the same reduction as the log-prob,
ALGORITHMS.md), or the sum.

Log-prob estimators on d = l_theta(x_{n+1}) - l_ref(x_{n+1}) (x_{n+1} sampled from the
policy), as in LLM RL libraries (``register_log_ratio_kl`` registers one from its function of d):

    k1 ("kl")            d
    abs                  |d|
    k2 ("mse")           d^2 / 2
    k3 ("low_var_kl")    exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ddpo_group.registry import Registry


@dataclass(frozen=True)
class KLKind:
    """A KL estimate of two step outputs."""

    name: str
    fn: Callable

    def __call__(self, policy, reference, reduce: str = "mean") -> torch.Tensor:
        return self.fn(policy, reference, reduce)


KL_KIND_REGISTRY = Registry("KL kind (kl.kind)")


def register_kl_kind(*names: str):
    """Decorator registering ``fn(policy_step, reference_step, reduce) -> KL [N]`` under each of ``names``."""
    def decorator(fn: Callable) -> KLKind:
        kind = KLKind(names[0], fn)
        for name in names:
            KL_KIND_REGISTRY.register(name)(kind)
        return kind
    return decorator


def register_log_ratio_kl(*names: str):
    """Decorator registering a log-prob estimator ``fn(d) -> [N]`` (d = l_theta - l_ref) under each of ``names``."""
    def decorator(fn: Callable) -> KLKind:
        return register_kl_kind(*names)(
            lambda policy, reference, reduce="mean": fn(policy.log_prob - reference.log_prob))
    return decorator


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


@register_kl_kind("gaussian")
def gaussian_step_kl(policy, reference, reduce: str = "mean") -> torch.Tensor:
    """The analytic KL of the two step Gaussians (shared sigma_n), from their means; gradient through the policy's."""
    return gaussian_kl(policy.mean, reference.mean, policy.std, reduce=reduce)


@register_log_ratio_kl("k1", "kl")
def k1(d: torch.Tensor) -> torch.Tensor:
    return d


@register_log_ratio_kl("abs")
def abs_kl(d: torch.Tensor) -> torch.Tensor:
    return d.abs()


@register_log_ratio_kl("k2", "mse")
def k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.pow(2)


@register_log_ratio_kl("k3", "low_var_kl")
def k3(d: torch.Tensor) -> torch.Tensor:
    neg = torch.clamp(-d, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)


def get_kl_kind(name: str) -> KLKind:
    """The KL kind registered under ``name``; ValueError listing the registered ones."""
    return KL_KIND_REGISTRY.get(name)


KL_CONTROLLER_REGISTRY = Registry("KL controller (kl.controller)")


@KL_CONTROLLER_REGISTRY.register("fixed")
class FixedKLController:
    """beta stays at ``value``; ``update`` is a no-op."""

    @classmethod
    def build(cls, value: float, target_kl: Optional[float] = None, horizon: Optional[float] = None):
        return cls(value)

    @staticmethod
    def config_errors(config) -> list:
        return []

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@KL_CONTROLLER_REGISTRY.register("adaptive")
class AdaptiveKLController:
    """PPO's adaptive KL coefficient (Ziegler et al. 2019), as in verl / trl.

        e     = clip(current_kl / target_kl - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    beta grows when the measured KL is above the target and shrinks when below.
    """

    @staticmethod
    def config_errors(config) -> list:
        kl, beta, errors = config.kl, config.kl.beta, []
        if not kl.target > 0:
            errors.append(f"kl.target={kl.target} must be > 0 with kl.controller='adaptive'")
        if not kl.horizon > 0:
            errors.append(f"kl.horizon={kl.horizon} must be > 0 with kl.controller='adaptive'")
        if not beta > 0:
            errors.append(f"kl.controller='adaptive' needs an initial kl.beta > 0, got {beta}")
        return errors

    @classmethod
    def build(cls, value: float, target_kl: Optional[float] = None, horizon: Optional[float] = None):
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon")
        return cls(value, target_kl, horizon)

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
    """The KL coefficient controller registered as ``kind`` ("fixed", "adaptive"), starting at ``value``."""
    return KL_CONTROLLER_REGISTRY.get(kind).build(value, target_kl, horizon)
