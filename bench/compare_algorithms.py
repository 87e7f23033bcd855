"""Learning proof: every preset trained for the same number of reward queries, several seeds each.

    python bench/compare_algorithms.py --presets ddpo,grpo,group_ppo --seeds 0,1,2 --queries 2048 --threshold 0.6

For each (preset, seed): the mean reward of the model on a fixed evaluation set (same prompts and
noise for every run) before and after training, the reward queries spent (ReMax's greedy samples
included), the queries needed until an epoch's mean reward reached ``--threshold``, and the wall
time; with the shapes_alignment reward also the joint accuracy (every attribute right) before and
after. Prints a markdown table (mean +- std over seeds), writes it with the raw rows to
``--out``/results.{md,json} and saves the reward-vs-queries curves to ``--out``/reward_vs_queries.png.
No accelerate launch needed: runs in this process, or ``--jobs N`` at once in worker processes
(each with cpu_count // N threads). Every finished run is saved at once; running the same command
again (or with more presets or seeds) skips the runs already in ``--out``/results.json. ``--set FIELD=VALUE`` overrides any config field.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config.base import PRESETS, get_config  # noqa: E402
from ddpo_group.algorithms import get_adv_estimator  # noqa: E402
from ddpo_group.run.metrics_log import read_metrics  # noqa: E402
from ddpo_group.prompts import PromptSampler  # noqa: E402
from ddpo_group.rollout.collect import collect_rollouts  # noqa: E402
from ddpo_group.run.trainer import Trainer  # noqa: E402


def set_field(config, key: str, raw: str) -> None:
    section, _, field = key.rpartition(".")
    target = config
    for part in section.split(".") if section else []:
        target = target[part]
    current = target[field] if field in target else ""  # a new key (e.g. a prompt_fn_kwargs entry): a string
    if isinstance(current, bool):
        value = raw.lower() in ("1", "true", "yes")
    elif isinstance(current, int):
        value = int(raw)
    elif isinstance(current, float) or current is None:
        value = float(raw)
    else:
        value = raw
    target[field] = value


@torch.no_grad()
def evaluate(trainer: Trainer, num_samples: int, seed: int = 1234) -> tuple[float, float | None]:
    """(mean reward, joint accuracy or None) of the current policy on a fixed evaluation set (fixed prompts and noise).

    The joint accuracy is the share of images whose every attribute the judge reads as asked
    (shapes_alignment's ``all_correct``); None for rewards that do not report it.
    """
    config = trainer.config
    sampler = PromptSampler(config.prompt_fn, config.prompt_fn_kwargs.to_dict(), seed=seed)
    prompts, metadata = sampler.sample(num_samples)
    device = trainer.accelerator.device
    generators = [torch.Generator(device=device).manual_seed(seed * 7919 + i) for i in range(num_samples)]
    sample_config = config.sample.copy_and_resolve_references()
    sample_config.num_batches_per_epoch = math.ceil(num_samples / sample_config.batch_size)
    trainer.unet.eval()
    with trainer.accelerator.autocast(), ThreadPoolExecutor(max_workers=2) as executor:
        batch = collect_rollouts(trainer.family, prompts, metadata, trainer.reward_fn, config.reward_fn, executor,
                                 sample_config, show_progress=False,
                                 generators=generators)
    accuracy = batch["reward_info"].get("all_correct")
    return float(batch["rewards"].mean()), None if accuracy is None else float(accuracy.float().mean())


def run_one(preset: str, seed: int, args) -> dict:
    config = get_config(preset)
    for item in args.set:
        key, _, raw = item.partition("=")
        set_field(config, key, raw)
    config.seed = seed
    config.wandb.mode = "disabled"
    config.save_freq = 0
    config.log_images_every = 0
    config.logdir = str(Path(args.out) / "runs")
    config.run_name = f"{preset}_seed{seed}"
    per_epoch = config.sample.batch_size * config.sample.num_batches_per_epoch
    if get_adv_estimator(config.algorithm.adv_estimator).needs_greedy_rewards:  # ReMax: one greedy query per group
        per_epoch += per_epoch // config.train.group_size
    config.num_epochs = max(1, args.queries // per_epoch)
    # a run cut short in an earlier attempt is not resumed: start it afresh (its metrics would add up)
    shutil.rmtree(Path(config.logdir) / config.run_name, ignore_errors=True)
    start = time.perf_counter()
    trainer = Trainer(config)
    before, accuracy_before = evaluate(trainer, args.eval_samples)
    trainer.run()
    after, accuracy_after = evaluate(trainer, args.eval_samples)
    wall = time.perf_counter() - start
    queries, curve = 0, []
    for m in read_metrics(trainer.run_dir / "metrics.jsonl"):
        queries += m["reward_queries"]
        curve.append((queries, m["reward_mean"]))
    return {"preset": preset, "seed": seed, "before": before, "after": after, "accuracy_before": accuracy_before,
            "accuracy_after": accuracy_after, "queries": queries, "wall_s": wall, "curve": curve}


def queries_to_reach(curve, threshold) -> int | None:
    """Reward queries spent until an epoch's mean reward first reached ``threshold`` (None: never, or no threshold)."""
    if threshold is None:
        return None
    return next((queries for queries, reward in curve if reward >= threshold), None)


def load_rows(path: Path, settings: dict) -> list[dict]:
    """The runs already in ``path`` (a study interrupted or run in parts); they must share ``settings``."""
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    if saved.get("settings") != settings:
        raise SystemExit(f"{path} holds runs with settings {saved.get('settings')}, not {settings}: "
                         "use another --out (or delete it) for a new study")
    return saved["rows"]


def save_rows(path: Path, settings: dict, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    os.replace(tmp, path)


def run_pool(jobs: int):
    """A pool of ``jobs`` worker processes (spawned: no torch state shared), or a null context for jobs = 1."""
    if jobs <= 1:
        return nullcontext(None)
    import multiprocessing

    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=torch.set_num_threads, initargs=(max(1, (os.cpu_count() or 1) // jobs),))


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return "never"
    t = torch.tensor(values, dtype=torch.float64)
    std = float(t.std(unbiased=False)) if len(values) > 1 else 0.0
    return f"{float(t.mean()):.4g} ± {std:.2g}"


def table(rows: list[dict], presets: list[str], threshold) -> str:
    with_accuracy = any(r.get("accuracy_before") is not None for r in rows)
    accuracy_head = " joint accuracy before | joint accuracy after |" if with_accuracy else ""
    head = (f"| preset | reward before | reward after | gain |{accuracy_head} reward queries | "
            f"queries to reach {threshold} | wall time (s) |\n|---|---|---|---|{'---|---|' if with_accuracy else ''}---|---|---|")
    out = [head]
    for preset in presets:
        rs = [r for r in rows if r["preset"] == preset]
        reached = [queries_to_reach(r["curve"], threshold) for r in rs]
        reach = mean_std(reached) + (f" ({sum(x is not None for x in reached)}/{len(rs)} seeds)" if rs else "")
        accuracy = (f" {mean_std([r.get('accuracy_before') for r in rs])} | {mean_std([r.get('accuracy_after') for r in rs])} |"
                    if with_accuracy else "")
        out.append(
            f"| {preset} | {mean_std([r['before'] for r in rs])} | {mean_std([r['after'] for r in rs])} | "
            f"{mean_std([r['after'] - r['before'] for r in rs])} |{accuracy} {mean_std([r['queries'] for r in rs])} | "
            f"{reach} | {mean_std([r['wall_s'] for r in rs])} |"
        )
    return "\n".join(out)


def moving_average(values: torch.Tensor, window: int) -> torch.Tensor:
    """Mean of the last ``window`` values at each position (fewer at the start), along the last dimension."""
    cumsum = torch.nn.functional.pad(values.cumsum(-1), (1, 0))
    ends = torch.arange(1, values.shape[-1] + 1)
    starts = (ends - window).clamp(min=0)
    return (cumsum[..., ends] - cumsum[..., starts]) / (ends - starts)


def plot(rows: list[dict], presets: list[str], path: Path, smooth: int = 5) -> None:
    """Epoch-mean reward against queries, mean over seeds (moving average over ``smooth`` epochs) with the
    seeds' spread shaded; the dashed line is the base model's evaluation reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for preset in presets:
        curves = [r["curve"] for r in rows if r["preset"] == preset]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        xs = [curves[0][i][0] for i in range(n)]
        ys = moving_average(torch.tensor([[c[i][1] for i in range(n)] for c in curves], dtype=torch.float64), smooth)
        mean, std = ys.mean(0), ys.std(0, unbiased=False)
        ax.plot(xs, mean.tolist(), label=preset, linewidth=2 if preset in ("ddpo", "grpo", "group_ppo") else 1)
        ax.fill_between(xs, (mean - std).tolist(), (mean + std).tolist(), alpha=0.12)
    befores = [r["before"] for r in rows]
    if befores:
        ax.axhline(sum(befores) / len(befores), color="gray", linestyle="--", label="base model (evaluation)")
    ax.set_xlabel("reward queries")
    ax.set_ylabel(f"epoch-mean reward (moving average over {smooth} epochs)")
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--queries", type=int, default=2048, help="reward queries per run")
    parser.add_argument("--threshold", type=float, default=None, help="reward level for 'queries to reach'")
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in its own process with cpu_count // jobs threads (1: in this process)")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    presets = [p for p in args.presets.split(",") if p]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"queries": args.queries, "eval_samples": args.eval_samples, "set": sorted(args.set)}
    rows = load_rows(out / "results.json", settings)
    done = {(r["preset"], r["seed"]) for r in rows}
    runs = [(preset, seed) for preset in presets for seed in seeds if (preset, seed) not in done]
    if done:
        print(f"{len(done)} runs already in {out / 'results.json'}; {len(runs)} to go", flush=True)
    with run_pool(args.jobs) as pool:
        finished = (as_completed([pool.submit(run_one, preset, seed, args) for preset, seed in runs]) if pool
                    else (run_one(preset, seed, args) for preset, seed in runs))
        for item in finished:
            row = item.result() if pool else item
            rows.append(row)
            save_rows(out / "results.json", settings, rows)  # after every run: an interrupted study loses nothing
            print(f"{row['preset']} seed {row['seed']}: {row['before']:.4f} -> {row['after']:.4f} in {row['queries']} "
                  f"queries, {row['wall_s']:.0f}s", flush=True)
    rows = [r for r in rows if r["preset"] in presets and r["seed"] in seeds]
    rows.sort(key=lambda r: (presets.index(r["preset"]), r["seed"]))
    text = table(rows, presets, args.threshold)
    print(text)
    (out / "results.md").write_text(text + "\n")
    plot(rows, presets, out / "reward_vs_queries.png")
    return rows


if __name__ == "__main__":
    main()
