"""One epoch's metrics, assembled from what its phases returned (one record: metrics.jsonl, wandb, the console)."""

from __future__ import annotations


def epoch_metrics(epoch: int, global_step: int, rollouts, train: dict, critic: dict, after: dict, shards,
                  filter_groups: bool) -> dict:
    """reward_* over every process's samples of the epoch, train/* (policy update), the estimator's metrics and, under
    multi_reward_mix="advantage_aggr", each reward component's adv/<component>/* (both of the first round), critic/*,
    ref/* and the controllers' (``after``), filter/* under dynamic sampling, reward_info/* (each component's mean over
    every process)."""
    rewards, batch = rollouts.rewards, rollouts.batch
    metrics = {
        "epoch": epoch,
        "global_step": global_step,
        "reward_mean": float(rewards.mean()),
        "reward_count": int(rewards.numel()),
        "reward_queries": rollouts.reward_queries,  # every reward evaluation of the epoch
        "reward_std": float(rewards.std(unbiased=False)),
        "reward_min": float(rewards.min()),  # the range the reward curve's std band is clipped to
        "reward_max": float(rewards.max()),
        **{f"train/{k}": v for k, v in train.items()},
        **{k: float(v) for k, v in rollouts.rounds[0].out.metrics.items()},
        **rollouts.rounds[0].component_metrics,
        **critic,
        **after,
    }
    if filter_groups:
        rounds = rollouts.rounds
        groups = sum(r.num_groups for r in rounds)
        metrics["filter/dropped_share"] = sum(r.dropped_share * r.num_groups for r in rounds) / groups
        metrics["filter/rounds"] = len(rounds)
        metrics["filter/batch_fill"] = float(shards.gather(batch["row_mask"]).mean())
    for key, value in batch["reward_info"].items():
        metrics[f"reward_info/{key}"] = float(shards.gather(value).float().mean())
    return metrics
