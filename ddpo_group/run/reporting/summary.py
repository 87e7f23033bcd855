"""The one-screen summary printed (and written to summary.txt) at the end of a run, and summary.json: the verdict and
the numbers behind it, for a person and for a script (bench/compare_algorithms.py, bench/guard_calibration.py)."""

from __future__ import annotations

import os
from pathlib import Path

from ddpo_group.run.reporting.verdict import verdict

NOT_MEASURED = "not_measured"  # summary.json's verdict of a run without the fresh final evaluation
SUMMARY_RECORD = "summary.json"


def summary_record(fresh: dict) -> dict:
    """summary.json: {"verdict", "why", "fresh": the fresh final evaluation (run/fresh_evaluation.py's report),
    "restores": [{"after_epoch", "to_epoch"}]}; without a fresh evaluation the verdict is "not_measured"."""
    if not fresh:
        return {"verdict": NOT_MEASURED, "why": "no fresh final evaluation (final_eval_num_seeds=0, or a resumed run "
                                                 "whose checkpoint held no base scores)", "fresh": {}, "restores": []}
    if "reward" not in fresh:  # a groupwise reward without a pointwise score (run/fresh_evaluation.py)
        return {"verdict": NOT_MEASURED, "why": "the reward is groupwise and declares no pointwise score: no image has a "
                                                "score of its own to compare with the base model's (scripts/evaluate.py "
                                                "compares the two models' images in one group)",
                "fresh": {k: v for k, v in fresh.items() if k != "restores"}, "restores": fresh["restores"]}
    final = fresh["reward"]["final"]
    heldout = fresh.get("heldout", {}).get("final")
    name, why = verdict(final["change"], final["se"], fresh["same_as_start"], heldout)
    return {"verdict": name, "why": why, "fresh": {k: v for k, v in fresh.items() if k != "restores"},
            "restores": fresh["restores"]}


def wandb_summary(record: dict) -> dict:
    """wandb's run summary of a run's end: the verdict and the fresh numbers (fresh/<measure>/<weights>/<number>)."""
    out = {"verdict": record["verdict"], "verdict_why": record["why"], "guard/restores": len(record["restores"])}
    for measure in ("reward", "heldout"):
        for weights, numbers in record["fresh"].get(measure, {}).items():
            out.update({f"fresh/{measure}/{weights}/{key}": numbers[key] for key in ("before", "after", "change", "se")})
    return out


def format_summary(metrics: list[dict], paths: dict[str, str | os.PathLike],
                   evaluations: list[dict] | None = None, notes: list[str] | None = None,
                   record: dict | None = None) -> str:
    """The verdict, reward before and after, the best epoch, throughput, and where the artefacts are.

    ``metrics`` are the per-epoch records of metrics.jsonl; ``paths`` maps a label to a path
    (only existing paths are listed), ``notes`` lines after them (the best evaluation's weights). ``record``:
    summary.json's (``summary_record``): with a fresh final evaluation, before -> after is its (the weights handed over
    against the base model on images nothing was chosen on, with the change's standard error), and the evaluations
    during training follow. With ``evaluations`` (eval.jsonl's records: the fixed evaluation during training), their
    first (before the first update) against their last, and the epoch means on one line; without, the first epoch's
    mean reward against the last's (means of freshly drawn prompts).
    """
    lines = ["=" * 72, "run summary", "-" * 72]
    metrics = [m for m in metrics if "reward_mean" in m]  # a supervised epoch (sft.epochs) samples nothing
    evaluations = [e for e in evaluations or [] if "eval/reward_mean" in e]
    if record and record.get("fresh"):
        lines += fresh_lines(record)
    if evaluations and not metrics:  # supervised epochs only (sft.epochs = num_epochs): the evaluations alone
        lines += evaluation_lines(evaluations, during=bool(record and record.get("fresh")))
    elif metrics and evaluations:
        lines += evaluation_lines(evaluations, during=bool(record and record.get("fresh")))
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


def fresh_lines(record: dict) -> list[str]:
    """The verdict and the fresh final evaluation: the weights handed over and the best evaluation's against the base
    model, each prompt's change, the held-out rewards, the restores."""
    fresh = record["fresh"]
    lines = [f"verdict          {record['why']}",
             f"fresh images     {fresh['images']} ({fresh['prompts']} prompts x {fresh['noises_per_prompt']} initial noises "
             f"no evaluation during training used), deterministic sampler, paired with the base model's"]
    trained = fresh.get("reward_measure", "eval/reward_mean")
    if trained != "eval/reward_mean":  # a groupwise reward: each image's pointwise score
        lines.append(f"{'reward':<17}a groupwise reward: each image's own score, {trained.removeprefix('eval/')}")
    for measure, label in (("reward", "reward"), ("heldout", "held-out")):
        if measure not in fresh:
            continue
        final = fresh[measure]["final"]
        lines += [f"{label + ' before':<17}{final['before']:.4f}  (the base model)",
                  f"{label + ' after':<17}{final['after']:.4f}  (the weights handed over: lora/ or the model)",
                  f"{'change':<17}{final['change']:+.4f} ± {final['se']:.4f} (standard error of the paired difference)"]
        if "best" in fresh[measure]:
            best = fresh[measure]["best"]
            lines.append(f"{'best evaluation':<17}{best['after']:.4f}, change {best['change']:+.4f} ± {best['se']:.4f} "
                         f"(the weights of epoch {best['epoch']}: lora_best/ or best/)")
        if measure == "reward":
            lines += [f"  {prompt}: {change:+.4f}" for prompt, change in final["per_prompt"].items()]
    for restore in record["restores"]:
        lines.append(f"{'restore':<17}after epoch {restore['after_epoch']}: the weights of epoch {restore['to_epoch']}")
    return lines


def evaluation_lines(evaluations: list[dict], during: bool = False) -> list[str]:
    """Before -> after of the fixed evaluation (same prompts, same initial noise, deterministic sampler), per component
    and per prompt group; ``during``: under the fresh final evaluation's lines, labelled as the evaluations during
    training."""
    first, last = evaluations[0], evaluations[-1]

    def when(record: dict) -> str:
        return "before training" if record["epoch"] < 0 else f"after epoch {record['epoch']}"

    weights = " with the EMA weights" if last.get("weights") == "ema" else ""
    chosen = ": the images the guard chose the best on" if during else ""
    lines = [
        f"{'during training' if during else 'evaluation':<17}{last.get('eval/num_images', '?')} images: fixed prompts x "
        f"fixed initial noise, deterministic sampler{weights}{chosen}",
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
