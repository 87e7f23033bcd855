"""Aggregation of a [B, T] (sample, denoising step) loss matrix into a scalar, plus masked stats.

The T denoising steps play the role of the tokens of LLM RL libraries. With m the 0/1 step
mask, N = sum_{i,n} m_{i,n} the number of trained (sample, step) pairs, B' the number of
trajectories with at least one trained step and T the number of steps:

=============================  =====================================  ============================
mode (verl alias)              loss                                   weight w_{i,n} (times m_{i,n})
=============================  =====================================  ============================
step-mean                      sum_{i,n} m L / N                      1 / N
(token-mean)
traj-mean-step-sum             (1/B') sum_i sum_n m L                 1 / B'
(seq-mean-token-sum)
traj-mean-step-mean            (1/B') sum_i (sum_n m L / sum_n m)     1 / (B' * sum_n m_{i,n})
(seq-mean-token-mean)
traj-mean-step-sum-norm        (1/B') sum_i (sum_n m L) / T           1 / (B' * T)
(seq-mean-token-sum-norm)
=============================  =====================================  ============================

``agg_loss(L, m, mode) == (aggregation_weights(m, mode) * L).sum()`` for every mode, so a
trainer that computes L chunk by chunk over flattened (sample, step) pairs can compute the
weights once for the whole batch and accumulate ``(w * L_chunk).sum()``.

Conventions: trajectories whose mask is all zero are not counted in B' (so dropping a group
by zeroing its mask does not dilute the loss); an all-zero mask gives weight 0 everywhere (a
zero loss, never NaN). Unlike verl, "traj-mean-step-sum-norm" averages over trajectories
(as its name says and as in Dr.GRPO's paper) instead of summing over them, which keeps the
loss scale independent of the micro-batch size.
"""

from __future__ import annotations

from typing import Optional

import torch

AGG_MODES = (
    "step-mean",
    "traj-mean-step-sum",
    "traj-mean-step-mean",
    "traj-mean-step-sum-norm",
)
AGG_ALIASES = {
    "token-mean": "step-mean",
    "seq-mean-token-sum": "traj-mean-step-sum",
    "seq-mean-token-mean": "traj-mean-step-mean",
    "seq-mean-token-sum-norm": "traj-mean-step-sum-norm",
}


def canonical_agg_mode(mode: str) -> str:
    """Map a mode or its verl alias to the step-based name; ValueError listing valid modes."""
    if mode in AGG_MODES:
        return mode
    if mode in AGG_ALIASES:
        return AGG_ALIASES[mode]
    raise ValueError(
        f"unknown loss_agg_mode {mode!r}; valid modes: {list(AGG_MODES)} "
        f"(verl aliases: {list(AGG_ALIASES)})"
    )


def _as_float_mask(mask: torch.Tensor, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    dtype = like.dtype if (like is not None and like.is_floating_point()) else torch.float32
    return (mask != 0).to(dtype)


def aggregation_weights(mask: torch.Tensor, mode: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Per-(sample, step) weights w [B, T] with agg_loss(L, mask, mode) == (w * L).sum().

    See the module docstring for the formula of each mode. Zero where mask is zero.
    """
    mode = canonical_agg_mode(mode)
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    m = (mask != 0).to(dtype or torch.float32)
    T = m.shape[1]
    row = m.sum(dim=1, keepdim=True)  # [B, 1]
    n_traj = (row > 0).sum().to(m.dtype)
    if mode == "step-mean":
        return m / m.sum().clamp(min=1.0)
    n_traj = n_traj.clamp(min=1.0)
    if mode == "traj-mean-step-sum":
        return m / n_traj
    if mode == "traj-mean-step-mean":
        return m / (row.clamp(min=1.0) * n_traj)
    # traj-mean-step-sum-norm
    return m / (float(T) * n_traj)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Aggregate a [B, T] loss matrix under the step mask (module docstring: formulas).

    Entries where the mask is 0 are ignored even if they are inf/NaN.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ")
    w = aggregation_weights(mask, mode, dtype=loss_mat.dtype if loss_mat.is_floating_point() else None)
    return (w * loss_mat.masked_fill(mask == 0, 0.0)).sum()


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    v = values.masked_fill(mask == 0, 0.0)
    return v.sum() if dim is None else v.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """sum(m * x) / sum(m) (0 when the mask is empty)."""
    m = _as_float_mask(mask, values)
    if dim is None:
        return masked_sum(values, mask) / m.sum().clamp(min=1.0)
    return masked_sum(values, mask, dim) / m.sum(dim=dim).clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (Bessel-corrected by default, as verl's masked_var)."""
    m = _as_float_mask(mask, values)
    n = m.sum()
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        var = var * n / (n - 1).clamp(min=1.0)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean_m(x)) / sqrt(var_m(x) + eps) with masked mean / unbiased masked variance.

    With shift_mean=False the mean is added back (scale only). Entries outside the mask are
    transformed too; callers multiply by the mask afterwards.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def masked_stats(values: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict:
    """Float metrics {prefix}mean/std/min/max of the masked entries (0.0 if none)."""
    sel = values[mask != 0]
    if sel.numel() == 0:
        return {f"{prefix}mean": 0.0, f"{prefix}std": 0.0, f"{prefix}min": 0.0, f"{prefix}max": 0.0}
    sel = sel.detach().double()
    return {
        f"{prefix}mean": float(sel.mean()),
        f"{prefix}std": float(sel.std(unbiased=False)),
        f"{prefix}min": float(sel.min()),
        f"{prefix}max": float(sel.max()),
    }


# ----------------------------------------------------------------------------------------------
# Group (prompt) reductions, vectorised with index_add / scatter_reduce (no loop over samples).


def compact_group_index(group_index: torch.Tensor):
    """Map arbitrary group ids [B] to 0..P-1 (sorted by id). Returns (index [B] long, P)."""
    group_index = torch.as_tensor(group_index)
    if group_index.dim() != 1:
        raise ValueError(f"group_index must be [B], got shape {tuple(group_index.shape)}")
    uniq, inverse = torch.unique(group_index, return_inverse=True)
    return inverse.long(), int(uniq.numel())


def group_sum(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum of ``values`` [B, ...] over the samples of each group -> [P, ...]."""
    out = torch.zeros((num_groups,) + tuple(values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, group_index, values)


def group_stats(values: torch.Tensor, group_index: torch.Tensor, num_groups: int, unbiased: bool = True):
    """Per-group (count, mean, std, min, max), each [P], of ``values`` [B].

    std is Bessel-corrected (torch.std's default, as verl's GRPO) when ``unbiased`` and the
    population std otherwise; groups with fewer than two samples have std 0 in both cases.
    """
    v = values
    ones = torch.ones_like(v)
    count = group_sum(ones, group_index, num_groups)
    mean = group_sum(v, group_index, num_groups) / count.clamp(min=1)
    sq = group_sum((v - mean[group_index]) ** 2, group_index, num_groups)
    denom = (count - 1) if unbiased else count
    std = torch.where(count > 1, torch.sqrt(sq / denom.clamp(min=1)), torch.zeros_like(sq))
    big = torch.finfo(v.dtype).max
    gmin = torch.full((num_groups,), big, dtype=v.dtype, device=v.device).scatter_reduce(
        0, group_index, v, reduce="amin", include_self=True)
    gmax = torch.full((num_groups,), -big, dtype=v.dtype, device=v.device).scatter_reduce(
        0, group_index, v, reduce="amax", include_self=True)
    return count, mean, std, gmin, gmax
