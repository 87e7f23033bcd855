"""Clipped value loss (PPO), under an arbitrary mask.

    v_clip = clip(v, v_old - c, v_old + c)
    L      = 0.5 * agg( max((v - y)^2, (v_clip - y)^2) )

with agg the aggregation of aggregation.py under the critic's own mask (all trained steps
for gae, the endpoint mask for group_ppo). ``clip_range=None`` disables the clipping.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .aggregation import agg_loss, masked_mean


def value_loss_matrix(values, old_values, returns, clip_range: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Unaggregated 0.5 * max((v - y)^2, (v_clip - y)^2) and the 'clip was active' indicator."""
    l1 = (values - returns).pow(2)
    if clip_range is None:
        return 0.5 * l1, torch.zeros_like(l1, dtype=torch.bool)
    v_clip = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    l2 = (v_clip - returns).pow(2)
    return 0.5 * torch.maximum(l1, l2), l2 > l1


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: Optional[float],
    loss_agg_mode: str = "step-mean",
):
    """Returns (loss, metrics) with metrics critic/value_loss, critic/clipfrac, critic/vpred_mean,
    critic/value_error.

    Shapes: any common shape (usually [B, T]); the aggregation modes need [B, T].
    Entries where mask == 0 never contribute, to the loss or to its gradient, even if NaN.
    """
    outside = mask == 0  # zero-filled first: a NaN times a zero weight would still reach the gradient
    values, old_values, returns = (x.masked_fill(outside, 0.0) for x in (values, old_values, returns))
    mat, clipped = value_loss_matrix(values, old_values, returns, clip_range)
    if mat.dim() == 1:
        mat, clipped, m2 = mat[:, None], clipped[:, None], mask[:, None]
    else:
        m2 = mask
    loss = agg_loss(mat, m2, loss_agg_mode)
    with torch.no_grad():
        metrics = {
            "critic/value_loss": float(loss),
            "critic/clipfrac": float(masked_mean(clipped.float(), m2)),
            "critic/vpred_mean": float(masked_mean(values.detach().reshape(m2.shape), m2)),
            "critic/value_error": float(masked_mean(((values.detach() - returns) ** 2).reshape(m2.shape), m2)),
        }
    return loss, metrics
