"""One epoch's metrics, assembled from what its phases returned (one record: metrics.jsonl, wandb, the console)."""

from __future__ import annotations


def epoch_metrics(epoch: int, global_step: int, rollouts, train: dict, after: dict) -> dict:
    """reward_* over every process's samples of the epoch, train/* (policy update), the estimator's metrics and, under
    multi_reward_mix="advantage_aggr", each reward component's adv/<component>/* (both of the first round), the
    components' (``after``: critic/*, ref/*, the controllers'), filter/* under dynamic sampling, reward_info/* (each component's mean over
    every process). It gathers nothing: the rollouts hold what was gathered over the processes."""
    rewards, first = rollouts.rewards, rollouts.rounds[0]
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
        **{k: float(v) for k, v in first.out.metrics.items()},
        **first.component_metrics,
        **after,
    }
    if rollouts.batch_fill is not None:  # dynamic sampling
        rounds = rollouts.rounds
        groups = sum(r.num_groups for r in rounds)
        metrics["filter/dropped_share"] = sum(r.dropped_share * r.num_groups for r in rounds) / groups
        metrics["filter/rounds"] = len(rounds)
        metrics["filter/batch_fill"] = rollouts.batch_fill
    for key, value in first.gathered.reward_info.items():
        metrics[f"reward_info/{key}"] = float(value.float().mean())
    return metrics
