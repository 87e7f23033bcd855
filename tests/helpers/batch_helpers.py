"""A RolloutBatch (sampling/batch.py) holding the fields a test exercises; the collector's other fields get neutral
values (empty prompts and metadata, blank images, zero rewards)."""

from __future__ import annotations

import torch

from ddpo_group.sampling.batch import RolloutBatch


def rollout_batch(cond: dict, latents: torch.Tensor, next_latents: torch.Tensor, log_probs: torch.Tensor, times: dict,
                  **fields) -> RolloutBatch:
    size = len(log_probs)
    made = dict(prompts=[""] * size, metadata=[{} for _ in range(size)], images=torch.zeros(size, 3, 1, 1),
                rewards=torch.zeros(size, dtype=torch.float64), reward_info={})
    made.update(fields)
    return RolloutBatch(cond=cond, latents=latents, next_latents=next_latents, log_probs=log_probs, times=times, **made)


def batch_of(traj, cond: dict, **fields) -> RolloutBatch:
    """The batch record of sampled ``traj`` (sampling/trajectories.py's Trajectories) under condition ``cond``."""
    return rollout_batch(cond, traj.latents[:, :-1], traj.latents[:, 1:], traj.log_probs, traj.times, **fields)
