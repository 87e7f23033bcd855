"""From the gathered epoch batch to advantages: the estimator by name, its parameters from the config.

Pure functions over global tensors (every process computes the same result from the gathered
batch and keeps its own rows), so they are tested without models or processes.
"""

from __future__ import annotations

import torch

from ddpo_group.algorithms import AdvantageInputs, AdvantageOutput, get_adv_estimator


def estimator_params(config, tau: float | None = None) -> dict:
    """Keyword parameters of ``algorithm.adv_estimator`` (estimators ignore the ones they do not take).

    grpo / grpo_passk / group_ppo: norm_adv_by_std = train.scale_rewards; grpo: global_std;
    gae: gamma, lam = algorithm.gae_lambda, whiten, gae_start_value; reinforce_plus_plus: gamma;
    group_ppo: tau (the controller's), group_max_size, group_epsilon, lam = group_params.lam.
    """
    a, g = config.algorithm, config.group_params
    params = {
        "adv_clip_max": config.train.adv_clip_max,
        "norm_adv_by_std": bool(config.train.scale_rewards),
        "global_std": bool(a.global_std),
        "gamma": float(a.gamma),
    }
    if a.adv_estimator == "gae":
        params.update(lam=float(a.gae_lambda), whiten=bool(a.gae_whiten), gae_start_value=a.gae_start_value)
    if a.adv_estimator == "group_ppo":
        params.update(
            tau=float(g.group_variance_threshold if tau is None else tau), group_max_size=int(g.group_max_size),
            group_epsilon=float(g.group_epsilon), lam=float(g.lam),
        )
    return params


def compute_advantages(
    config,
    rewards: torch.Tensor,
    groups: torch.Tensor,
    prompts: list[str],
    num_steps: int,
    stat_tracker=None,
    values: torch.Tensor | None = None,
    step_rewards: torch.Tensor | None = None,
    greedy_rewards: torch.Tensor | None = None,
    tau: float | None = None,
) -> AdvantageOutput:
    """The estimator's output on the whole (gathered) batch: advantages [B, T], returns, masks, metrics.

    Every step is part of the estimator's step mask (the policy update chooses its trained steps
    itself); the advantages of untrained steps are simply not used.
    """
    inputs = AdvantageInputs(
        rewards=rewards.double(),
        step_mask=torch.ones(len(prompts), num_steps, dtype=torch.float64),
        group_index=torch.as_tensor(groups, dtype=torch.long),
        prompts=list(prompts),
        values=None if values is None else values.double(),
        step_rewards=None if step_rewards is None else step_rewards.double(),
        greedy_rewards=None if greedy_rewards is None else greedy_rewards.double(),
        stat_tracker=stat_tracker,
    )
    return get_adv_estimator(config.algorithm.adv_estimator)(inputs, **estimator_params(config, tau))


def critic_regression(config, out: AdvantageOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, mask) [B, T] of the critic in pre-step indexing: every step for gae, endpoints for group_ppo."""
    if config.algorithm.adv_estimator == "group_ppo":
        return out.critic_targets, out.endpoint_mask
    return out.returns, torch.ones_like(out.returns)
