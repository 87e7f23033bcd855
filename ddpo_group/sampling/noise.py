"""The noise of one sampling round, a function of (seed, epoch, round) only: the same on every process and
whatever the process count, so runs resume exactly and 1 or N processes draw the same images."""

from __future__ import annotations

import torch


def round_seed(seed: int, epoch: int, round_index: int) -> int:
    """The base seed of one sampling round."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + round_index) * 1_000_003


def sample_generators(base_seed: int, mine: slice, device) -> list[torch.Generator]:
    """One generator per sample of this process's slice ``mine`` of the round, seeded by its global index."""
    return [torch.Generator(device=device).manual_seed((base_seed + index) % 2**63)
            for index in range(mine.start, mine.stop)]


def group_initial_noise(base_seed: int, groups: list[int], shape: tuple[int, ...], device) -> torch.Tensor:
    """x_0 [B, *shape] drawn once per prompt group (seeded by the group index) and shared by its copies.

    The copies then differ only by their step noise, so the group baseline also removes the reward
    variance due to x_0, which no action can be credited with (DanceGRPO's shared initial noise).
    """
    base = base_seed + 2**40  # apart from the per-sample generators' seeds
    noise = {g: torch.randn(shape, generator=torch.Generator().manual_seed((base + g) % 2**63)) for g in set(groups)}
    return torch.stack([noise[g] for g in groups]).to(device)
