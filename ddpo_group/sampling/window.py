"""Which steps are stochastic (and trained): an SDE window, as in Flow-GRPO-Fast.

Only the steps [start, start + size) draw noise and have a log-probability; the others are deterministic steps of
the same sampler (DDIM with eta = 0, the flow's Euler step). Size 0: every step.
"""

from __future__ import annotations

import torch


def sde_window_mask(num_steps: int, window_start: int = 0, window_size: int = 0) -> torch.Tensor:
    """[T] bool: the stochastic (and trainable) steps. Size 0: every step; otherwise the steps
    [start, start + size), the others being deterministic DDIM steps (eta = 0), as in Flow-GRPO-Fast."""
    mask = torch.zeros(num_steps, dtype=torch.bool)
    if window_size <= 0:
        mask[:] = True
    else:
        mask[window_start : window_start + window_size] = True
    return mask


def stochastic_steps(sample_config) -> torch.Tensor:
    """[T] bool of the sampling config: its SDE window (``sample.sde_window_start``/``_size``) or every step."""
    return sde_window_mask(sample_config.num_steps, int(sample_config.sde_window_start),
                           int(sample_config.sde_window_size))
