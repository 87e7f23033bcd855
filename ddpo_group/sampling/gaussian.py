"""What every sampler step shares: its record and the Gaussian log-density of the next latent.

A stochastic step is x_{n+1} ~ N(mean, std^2 I) with one std per row; its log-probability is

    l = reduce( -(x_{n+1} - mean)^2 / (2 std^2) - log std - log sqrt(2 pi) )

reduced over every latent dimension (``sample.log_prob_reduce``: the mean, DDPO's convention, or the sum), computed
in float32 or, ``sample.log_prob_dtype="float64"``, in float64 (Flow-Factory's reduction: the sum over a large
latent's D elements rounds about D times more than the mean, which float32 makes visible against a clip range of 1e-4).

Every step also reports its length on the flow-matching time axis, ``step_length`` = s_n - s_{n+1} > 0 (flow
steps: -dt; DDIM: the same on the equivalent flow time, sampling/ddim.py): GRPO-Guard's per-step loss weight
1 / step_length (algorithms/policy_losses.py, ``ratio_norm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
REDUCTIONS = ("mean", "sum")
LOG_PROB_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class StepOutput:
    next_latents: torch.Tensor  # x_{n+1}, [N, ...] (float32)
    log_prob: torch.Tensor | None  # l_n, [N]; None when not requested
    mean: torch.Tensor  # mu_n, [N, ...]
    std: torch.Tensor  # sigma_n, [N]
    step_length: torch.Tensor | None = None  # s_n - s_{n+1} > 0 on the flow time axis, [N] (None: not known)
    clean_hat: torch.Tensor | None = None  # clean_hat(x_n): the step's one-step (Tweedie) prediction of the clean latent


def per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a [N] tensor against a [N, ...] tensor."""
    return values.reshape(values.shape + (1,) * (like.ndim - values.ndim))


def reduce_latent_dims(x: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """Reduce every dimension but the first (DDPO's convention is the mean)."""
    dims = tuple(range(1, x.ndim))
    if reduce == "mean":
        return x.mean(dim=dims)
    if reduce == "sum":
        return x.sum(dim=dims)
    raise ValueError(f"reduce={reduce!r} is not a log-prob reduction; use one of {REDUCTIONS}")


def gaussian_log_prob(next_latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduce: str = "mean",
                      dtype: str = "float32") -> torch.Tensor:
    """l [N] of ``next_latents`` under N(mean, std^2) (std [N]), no gradient through the sample, computed in ``dtype``
    ("float32": as the step's math; "float64": the three cast up first)."""
    if dtype != "float32":
        if dtype not in LOG_PROB_DTYPES:
            raise ValueError(f"log-prob dtype {dtype!r} must be one of {list(LOG_PROB_DTYPES)}")
        next_latents, mean, std = (x.to(LOG_PROB_DTYPES[dtype]) for x in (next_latents, mean, std))
    std_b = per_row(std, mean)
    log_density = -((next_latents.detach() - mean) ** 2) / (2 * std_b**2) - torch.log(std_b) - LOG_SQRT_2PI
    return reduce_latent_dims(log_density, reduce)
