"""The one-screen summary printed (and written to summary.txt) at the end of a run."""

from __future__ import annotations

import os
from pathlib import Path


def format_summary(metrics: list[dict], paths: dict[str, str | os.PathLike],
                   evaluations: list[dict] | None = None, notes: list[str] | None = None) -> str:
    """Reward before and after, the best epoch, throughput, and where the artefacts are.

    ``metrics`` are the per-epoch records of metrics.jsonl; ``paths`` maps a label to a path
    (only existing paths are listed), ``notes`` lines after them (the best evaluation's weights). With ``evaluations`` (eval.jsonl's records: the fixed evaluation during
    training), before -> after is the first evaluation (before the first update) against the last, and the epoch
    means follow on one line; without, before -> after is the first epoch's mean reward against the last's (means of
    freshly drawn prompts).
    """
    lines = ["=" * 72, "run summary", "-" * 72]
    evaluations = [e for e in evaluations or [] if "eval/reward_mean" in e]
    if metrics and evaluations:
        lines += evaluation_lines(evaluations)
        first, last = metrics[0], metrics[-1]
        best = max(metrics, key=lambda m: m["reward_mean"])
        lines.append(f"epoch means      {first['reward_mean']:.4f} (epoch {first['epoch']}) -> {last['reward_mean']:.4f} "
                     f"(epoch {last['epoch']}), best epoch {best['epoch']}: {best['reward_mean']:.4f} (training "
                     "prompts, drawn afresh each epoch)")
        lines += throughput_lines(metrics)
    elif metrics:
        first, last = metrics[0], metrics[-1]
        best = max(metrics, key=lambda m: m["reward_mean"])
        change = last["reward_mean"] - first["reward_mean"]
        lines += [
            f"epochs           {first['epoch']} .. {last['epoch']} ({len(metrics)} logged)",
            f"reward before    {first['reward_mean']:.4f} ± {first.get('reward_std', 0.0):.4f}  (epoch {first['epoch']})",
            f"reward after     {last['reward_mean']:.4f} ± {last.get('reward_std', 0.0):.4f}  (epoch {last['epoch']})",
            f"change           {change:+.4f}",
            f"best epoch       {best['epoch']}: {best['reward_mean']:.4f}",
        ]
        components = sorted(k for k in last if k.startswith("reward_info/") and k.count("/") == 1)
        for key in components:
            if key in first:
                lines.append(f"  {key[len('reward_info/'):]}: {first[key]:.4f} -> {last[key]:.4f}")
        lines += throughput_lines(metrics)
    else:
        lines.append("no epoch finished")
    lines.append("-" * 72)
    for label, path in paths.items():
        if path and Path(path).exists():
            lines.append(f"{label:<17}{path}")
    lines += notes or []
    lines.append("=" * 72)
    return "\n".join(lines)


def evaluation_lines(evaluations: list[dict]) -> list[str]:
    """Before -> after of the fixed evaluation (same prompts, same initial noise, deterministic sampler), per component
    and per prompt group."""
    first, last = evaluations[0], evaluations[-1]

    def when(record: dict) -> str:
        return "before training" if record["epoch"] < 0 else f"after epoch {record['epoch']}"

    weights = " with the EMA weights" if last.get("weights") == "ema" else ""
    lines = [
        f"evaluation       {last.get('eval/num_images', '?')} images: fixed prompts x fixed initial noise, deterministic "
        f"sampler{weights}",
        f"reward before    {first['eval/reward_mean']:.4f} ± {first['eval/reward_std']:.4f}  (evaluation {when(first)})",
        f"reward after     {last['eval/reward_mean']:.4f} ± {last['eval/reward_std']:.4f}  (evaluation {when(last)})",
        f"change           {last['eval/reward_mean'] - first['eval/reward_mean']:+.4f}",
    ]
    skip = ("eval/reward_mean", "eval/reward_std", "eval/num_images")
    for key in [k for k in last if k.startswith("eval/") and k not in skip and k in first
                and not k.startswith("eval/drift/")]:  # a drift is its image statistic's change, shown by that
        lines.append(f"  {key[len('eval/'):]}: {first[key]:.4f} -> {last[key]:.4f}")
    if "eval_heldout/reward_mean" in first and "eval_heldout/reward_mean" in last:  # eval_reward_fn: never trained on
        lines += [f"held-out reward  {first['eval_heldout/reward_mean']:.4f} -> {last['eval_heldout/reward_mean']:.4f} "
                  f"({last['eval_heldout/reward_mean'] - first['eval_heldout/reward_mean']:+.4f}; eval_reward_fn, not "
                  "trained on)"]
        heldout = [k for k in last if k.startswith("eval_heldout/") and k in first
                   and k not in ("eval_heldout/reward_mean", "eval_heldout/reward_std")]
        lines += [f"  {key[len('eval_heldout/'):]}: {first[key]:.4f} -> {last[key]:.4f}" for key in heldout]
    return lines


def throughput_lines(metrics: list[dict]) -> list[str]:
    """Images sampled and pairs trained per second, peak memory and MFU over the run (run/reporting/throughput.py).

    Rates are total count / total phase time, MFU the time-weighted mean of the epochs' (the same ratio of sums),
    both over the epochs after the first when there are several (the first carries the warm-up: allocator growth,
    kernel selection, compilation); peak memory is the largest of every epoch.
    """
    if "perf/images_sampled" not in metrics[-1]:
        return []  # a run logged before throughput was
    steady = metrics[1:] if len(metrics) > 1 else metrics
    span = f"epochs {steady[0]['epoch']}..{steady[-1]['epoch']}" if len(steady) > 1 else f"epoch {steady[0]['epoch']}"

    def ratio(count: str, seconds: str) -> float | None:
        total = sum(m.get(seconds, 0.0) for m in steady)
        return sum(m.get(count, 0) for m in steady) / total if total > 0 else None

    def weighted(key: str, seconds: str) -> float | None:
        timed = [(m[key], m[seconds]) for m in steady if key in m]
        total = sum(t for _, t in timed)
        return sum(v * t for v, t in timed) / total if timed and total > 0 else None

    images, pairs = ratio("perf/images_sampled", "time/sampling"), ratio("perf/pairs_trained", "time/training")
    rates = [f"{value:.3g} {unit}" for value, unit in ((images, "img/s sampled"), (pairs, "pairs/s trained"))
             if value is not None]
    lines = [f"throughput       {', '.join(rates)}  ({span})"] if rates else []
    memory = [f"{max(m[key] for m in metrics if key in m):.2f} GiB {name}"
              for key, name in (("perf/cuda_max_allocated_gb", "CUDA max allocated"), ("perf/rss_gb", "RSS"))
              if any(key in m for m in metrics)]
    if memory:
        lines.append(f"peak memory      {', '.join(memory)}")
    mfu = [f"{100 * value:.3g}% {name}" for value, name in ((weighted("perf/mfu_training", "time/training"), "training"),
                                                      (weighted("perf/mfu_sampling", "time/sampling"), "sampling"))
           if value is not None]
    if mfu:
        lines.append(f"MFU              {', '.join(mfu)}")
    return lines
