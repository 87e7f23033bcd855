"""Several rewards, one advantage: sum then normalise (default), or normalise each component then sum (GDPO).

With a weighted combination ``reward_fn = {name_k: w_k}`` (rewards/combine.py) every sample i has the
component rewards r_{i,k}. ``algorithm.multi_reward_mix`` chooses what the advantage estimator gets as the
reward of sample i:

* ``"reward_aggr"`` (default; Flow-GRPO's ``multi_score``): R_i = sum_k w_k r_{i,k}, which the estimator
  normalises as one reward.
* ``"advantage_aggr"`` (GDPO, Liu et al. 2026, arXiv:2601.05242; MixGRPO's ``multi_reward_mix="advantage_aggr"``):
  each component is normalised within its prompt group g(i) before the weighted sum::

      z_{i,k} = (r_{i,k} - mean_g(r_k)) / (std_g(r_k) + eps)      std_g Bessel-corrected, eps = 1e-6
      S_i     = sum_k w_k z_{i,k}

  and the estimator gets S_i. A component whose rewards are equal in a group gives 0 there, and a component's
  scale (kB of JPEG against a probability) no longer decides its share of the advantage: its weight does.

Every z_k has mean 0 in every group, so S does too: the group estimator's baseline is 0 and what it does next is
the normalisation after the sum:

* ``dr_grpo`` (or ``grpo`` with ``train.scale_rewards=False``): A = S, MixGRPO's advantage (MixGRPO also scales
  the weights to sum to 1: give them so);
* ``grpo`` with ``algorithm.global_std=True``: A = S / (std_batch(S) + eps), GDPO's batch-wise normalisation
  (GDPO subtracts the batch mean of S, which is 0 as well);
* ``rloo``: A = G / (G - 1) * S.

``grpo`` dividing S by its *group* std again would give every 2-sample group the advantages +-1/sqrt(2) whatever
its components did, the collapse of distinct reward combinations that GDPO removes; the config checks reject it
(run/config_checks.py). Estimators that do not compare a prompt group's samples, or that fit a critic to the
reward (S depends on the group's other samples, not on the sample alone), are rejected too.

The sources agree on the group statistics (torch's Bessel-corrected std in NVlabs/GDPO's TRL and verl versions
and in MixGRPO) and differ in eps (TRL-GDPO 1e-4, verl-GDPO 1e-6, MixGRPO 1e-8). eps = 1e-6 is verl's and this
package's grpo eps, so that one component of weight 1 under dr_grpo gives exactly grpo's advantages of that reward.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from .aggregation import compact_group_index, group_stats, masked_stats
from .filters import zero_variance_group_filter

MULTI_REWARD_MIXES = ("reward_aggr", "advantage_aggr")
COMPONENT_EPS = 1e-6


def component_normalized_sum(components: torch.Tensor, weights: Sequence[float], group_index: torch.Tensor,
                             eps: float = COMPONENT_EPS) -> Tuple[torch.Tensor, torch.Tensor]:
    """(S [B], z [B, K]), float64: z_{i,k} = (r_{i,k} - mean_g(r_k)) / (std_g(r_k) + eps), S_i = sum_k w_k z_{i,k}.

    ``components`` [B, K] are the unweighted rewards r_{i,k}, ``weights`` the K weights w_k, ``group_index`` [B]
    the prompt group of each sample (any ids); std_g is Bessel-corrected (module docstring).
    """
    r = torch.as_tensor(components).detach().double()
    if r.dim() != 2:
        raise ValueError(f"components must be [B, K], got shape {tuple(r.shape)}")
    w = torch.as_tensor(list(weights), dtype=torch.float64, device=r.device)
    if w.shape != (r.shape[1],):
        raise ValueError(f"{w.numel()} weights for {r.shape[1]} reward components")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("reward components contain non-finite values")
    gi, P = compact_group_index(torch.as_tensor(group_index, device=r.device))
    if gi.shape[0] != r.shape[0]:
        raise ValueError(f"group_index has {gi.shape[0]} entries for {r.shape[0]} samples")
    z = torch.empty_like(r)
    for k in range(r.shape[1]):  # K is a handful of rewards; each column is vectorised over groups
        _, mean, std, _, _ = group_stats(r[:, k], gi, P, unbiased=True)
        z[:, k] = (r[:, k] - mean[gi]) / (std[gi] + eps)
    return (z * w).sum(dim=1), z


def component_metrics(components: torch.Tensor, z: torch.Tensor, labels: List[str],
                      group_index: torch.Tensor) -> Dict[str, float]:
    """``adv/<label>/{mean,std,min,max}`` of each component's normalised advantage z_k (unweighted) and
    ``adv/<label>/zero_std_ratio``, the share of prompt groups in which the component is constant (it gives them 0)."""
    metrics = {}
    ones = torch.ones_like(z[:, 0])
    for k, label in enumerate(labels):
        metrics.update(masked_stats(z[:, k], ones, f"adv/{label}/"))
        _, metrics[f"adv/{label}/zero_std_ratio"] = zero_variance_group_filter(components[:, k].double(), group_index)
    return metrics
