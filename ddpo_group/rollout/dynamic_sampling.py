"""DAPO's dynamic sampling: drop prompt groups whose rewards are all equal, sample more until the batch is full.

A group whose G rewards are equal (population std <= eps) has zero group-relative advantage:
it costs a training forward and teaches nothing. With ``algorithm.filter_groups`` the trainer
samples further rounds (new prompts, advantages computed per round on the gathered round, so
every group is complete) until every process holds ``local`` rows of kept groups, or
``algorithm.max_num_gen_batches`` rounds were sampled. Each process then trains on its first
``local`` kept rows; a process still short pads with dropped rows whose ``row_mask`` is 0 (they
take no part in the loss or its aggregation), so every process runs the same number of steps.
"""

from __future__ import annotations

import torch

from ddpo_group.algorithms import zero_variance_group_filter


def group_keep_mask(rewards: torch.Tensor, groups, eps: float = 1e-6) -> tuple[torch.Tensor, float]:
    """keep [B] bool (the sample's group has reward variance) and the dropped share of groups."""
    return zero_variance_group_filter(rewards.double(), torch.as_tensor(groups), eps=eps)


def pool_rows(batches: list[dict], keeps: list[torch.Tensor], size: int) -> dict:
    """The first ``size`` kept rows of this process's rounds, padded with dropped rows; adds ``row_mask`` [size].

    ``batches`` are the rounds' local batch records, ``keeps`` their local keep masks [local] bool.
    Tensor and list entries are gathered row by row; ``reward_info`` is the first round's.
    """
    kept = [(r, i) for r, keep in enumerate(keeps) for i in range(len(keep)) if keep[i]]
    dropped = [(r, i) for r, keep in enumerate(keeps) for i in range(len(keep)) if not keep[i]]
    picks = (kept + dropped)[:size]
    pooled = {}
    for key, first in batches[0].items():
        if key == "reward_info":
            pooled[key] = first
        elif isinstance(first, list):
            pooled[key] = [batches[r][key][i] for r, i in picks]
        elif isinstance(first, torch.Tensor):
            pooled[key] = torch.stack([batches[r][key][i] for r, i in picks])
    device = batches[0]["log_probs"].device
    pooled["row_mask"] = torch.tensor([1.0 if keeps[r][i] else 0.0 for r, i in picks], device=device)
    return pooled
