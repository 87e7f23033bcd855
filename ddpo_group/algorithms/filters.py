"""Zero-variance group filter (DAPO's dynamic sampling).

A prompt group whose rewards are all equal has a zero group-relative advantage: it carries no
learning signal. ``zero_variance_group_filter`` flags such groups: a group has zero variance
when the population std of its rewards is <= eps (a single-sample group counts as zero
variance). It returns keep_mask [B] (True for samples of groups with signal) and
zero_std_ratio = (# zero-variance groups) / (# groups), which the trainer logs.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .aggregation import compact_group_index, group_stats


def zero_variance_group_filter(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> Tuple[torch.Tensor, float]:
    """keep_mask [B] bool (std_g(R) > eps) and the share of zero-variance groups (float)."""
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    gi, P = compact_group_index(torch.as_tensor(group_index, device=rewards.device))
    if gi.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards [{rewards.shape[0]}] and group_index [{gi.shape[0]}] differ in length")
    if P == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device), 0.0
    _, _, std, _, _ = group_stats(rewards.detach().double(), gi, P, unbiased=False)
    zero = std <= eps
    return ~zero[gi], float(zero.double().mean())
