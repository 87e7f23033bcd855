"""Reward hacking on the embedded model, shown and guarded: a proxy reward that can be hacked, the task's own reward
held out, and what the guard, the KL term, GRPO-Guard's ratio normalisation and a pairwise reward do about it.

    python bench/reward_hacking.py --out docs/studies/hacking --seeds 0,1,2 --jobs 2

Every run is a preset's default configuration (the embedded tiny-shapes model, 40 epochs of 32 images) trained on
``--proxy`` (default jpeg_compressibility: the smaller the JPEG, the higher the reward) with the task's reward
shapes_alignment held out (``eval_reward_fn``), evaluated every ``--eval-freq`` epochs. Rows, for grpo and group_ppo:

    plain         the preset without a KL term (grpo's kl.beta=0.004 removed)
    kl            kl.beta=0.04 to the base model (Flow-GRPO's SD3.5 recipe's weight)
    ratio_norm    algorithm.policy_loss=ratio_norm (GRPO-Guard)
    dppo          algorithm.policy_loss=dppo (Flow-DPPO's exact-KL mask: "less forgetting"), no KL term
    pairwise      reward_fn=win_rate under the judge "reward" of the proxy: each image's share of wins in its group

Per run, from its eval.jsonl: the epoch where the held-out reward has fallen (the first evaluation more than 2
standard errors below its value before training, SE = its std over the evaluation's images / sqrt(images)), the
epoch the guard's held-out rule fires (its default rules replayed on the records: run/guard.py), the held-out reward
of the kept best weights (lora_best/) and at the end against the start, and the proxy's evaluation gain. Writes
results.json, results.md, hacking.png (held-out and proxy reward per evaluation, mean over seeds) and the grids of
seed 0's plain grpo run before training and after its last epoch.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.guard_calibration import margins  # noqa: E402
from config.base import get_config  # noqa: E402

VARIANTS = {
    "plain": ["--config.kl.beta=0", "--config.kl.use_reference_model=False"],
    "kl": ["--config.kl.beta=0.04", "--config.kl.use_reference_model=True"],
    "ratio_norm": ["--config.kl.beta=0", "--config.kl.use_reference_model=False",
                   "--config.algorithm.policy_loss=ratio_norm"],
    "dppo": ["--config.kl.beta=0", "--config.kl.use_reference_model=False", "--config.algorithm.policy_loss=dppo"],
    "pairwise": ["--config.kl.beta=0", "--config.kl.use_reference_model=False", "--config.reward_fn=win_rate",
                 '--config.reward_fn_kwargs={{"judge": "reward", "judge_kwargs": {{"reward_fn": "{proxy}"}}}}'],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the study's directory (runs/ inside; kept runs are not run again)")
    p.add_argument("--presets", default="grpo,group_ppo")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--proxy", default="jpeg_compressibility", help="the reward trained on")
    p.add_argument("--heldout", default="shapes_alignment", help="the reward held out (eval_reward_fn)")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--eval-freq", type=int, default=5)
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each")
    p.add_argument("--set", action="append", default=[], help="FIELD=VALUE for every run")
    return p.parse_args(argv)


def command(args, preset: str, variant: str, seed: int, run_dir: Path) -> list[str]:
    extra = [flag.format(proxy=args.proxy) for flag in VARIANTS[variant]]
    return [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", f"{ROOT / 'config' / 'base.py'}:{preset}",
            f"--config.reward_fn={args.proxy}", f"--config.eval_reward_fn={args.heldout}",
            f"--config.eval_freq={args.eval_freq}", f"--config.num_epochs={args.epochs}", f"--config.seed={seed}",
            "--config.num_cpu_threads=1", "--config.device=cpu", "--config.wandb.mode=disabled",
            "--config.save_freq=0", "--config.log_images_every=0", f"--config.logdir={run_dir.parent}",
            f"--config.run_name={run_dir.name}", *extra, *[f"--config.{item}" for item in args.set]]


def run(args, preset: str, variant: str, seed: int) -> Path:
    run_dir = Path(args.out) / "runs" / f"{preset}_{variant}_seed{seed}"
    if (run_dir / "summary.json").is_file():  # a finished run is kept (a stopped one has summary.txt only)
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        done = subprocess.run(command(args, preset, variant, seed, run_dir), stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed (exit {done.returncode}): see {run_dir.parent / run_dir.name}.log")
    return run_dir


def measures(run_dir: Path, guard_config) -> dict:
    records = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    start = records[0]
    se = start["eval_heldout/reward_std"] / math.sqrt(start["eval/num_images"])
    fallen = next((r["epoch"] for r in records[1:]
                   if r["eval_heldout/reward_mean"] < start["eval_heldout/reward_mean"] - 2 * se), None)
    guard = margins(records, guard_config)  # every rule replayed, the groupwise rows on their judge's score
    best = json.loads((run_dir / "lora_best" / "best.json").read_text())
    # the proxy's evaluation: a win rate's mean over a group is 0.5 whatever the images, so the pairwise rows read the
    # judge's own score of each image (its info's "score": the proxy reward)
    proxy = [r[guard["rising"]] for r in records]
    return {"epochs": [r["epoch"] for r in records], "heldout": [r["eval_heldout/reward_mean"] for r in records],
            "proxy": proxy, "fallen": fallen, "fired": guard["fired"], "drift": guard["drift"],
            "best_epoch": best["epoch"], "best_heldout": best["score"], "start_heldout": start["eval_heldout/reward_mean"],
            "end_heldout": records[-1]["eval_heldout/reward_mean"],
            "proxy_gain": proxy[-1] - proxy[0]}


def mean_std(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5
    return f"{mean:+.3f} ± {std:.3f}" if abs(mean) < 10 else f"{mean:.0f} ± {std:.0f}"


def epochs_text(values: list, total: int) -> str:
    seen = [v for v in values if v is not None]
    if not seen:
        return f"never (0 of {total})"
    return f"{sum(seen) / len(seen):.1f} ({', '.join(str(v) for v in values if v is not None)}; {len(seen)} of {total})"


def table(rows: dict, args) -> str:
    lines = ["| row | held-out fell (epoch) | held-out rule fired (epoch) | drift rule fired (epoch) | "
             "held-out: start -> end | kept best (epoch) | best - start | proxy gain |", "|---|---|---|---|---|---|---|---|"]
    for label, runs in rows.items():
        start = [r["start_heldout"] for r in runs]
        lines.append(
            f"| {label} | {epochs_text([r['fallen'] for r in runs], len(runs))} | "
            f"{epochs_text([r['fired'].get('heldout') for r in runs], len(runs))} | "
            f"{epochs_text([r['fired'].get('drift') for r in runs], len(runs))} | "
            f"{sum(start) / len(start):.3f} -> {sum(r['end_heldout'] for r in runs) / len(runs):.3f} | "
            f"{sum(r['best_epoch'] for r in runs) / len(runs):.1f} | "
            f"{mean_std([r['best_heldout'] - r['start_heldout'] for r in runs])} | "
            f"{mean_std([r['proxy_gain'] for r in runs])} |")
    return "\n".join(lines)


def plot(rows: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    presets = sorted({label.split(" ")[0] for label in rows})
    figure = Figure(figsize=(11, 4.2 * len(presets)), layout="constrained")
    for i, preset in enumerate(presets):
        heldout, proxy = figure.add_subplot(len(presets), 2, 2 * i + 1), figure.add_subplot(len(presets), 2, 2 * i + 2)
        for label, runs in rows.items():
            if label.split(" ")[0] != preset:
                continue
            epochs = runs[0]["epochs"]
            for axes, key in ((heldout, "heldout"), (proxy, "proxy")):
                mean = [sum(r[key][k] for r in runs) / len(runs) for k in range(len(epochs))]
                axes.plot(epochs, mean, marker="o", markersize=3, label=label.split(" ", 1)[1])
        heldout.set_title(f"{preset}: held-out shapes_alignment (not trained on)")
        proxy.set_title(f"{preset}: the proxy reward trained on (its evaluation)")
        for axes in (heldout, proxy):
            axes.set_xlabel("epoch (-1: before training)")
            axes.grid(alpha=0.3)
            axes.legend(fontsize=8)
    figure.savefig(out)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    guard_config = get_config("grpo").guard
    jobs = [(preset, variant, seed) for preset in args.presets.split(",") for variant in args.variants.split(",")
            for seed in map(int, args.seeds.split(","))]
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda job: run(args, *job), jobs))
    rows: dict[str, list] = {}
    for (preset, variant, seed), run_dir in zip(jobs, done):
        rows.setdefault(f"{preset} {variant}", []).append({"seed": seed, **measures(run_dir, guard_config)})
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    text = (f"Proxy `{args.proxy}`, held out `{args.heldout}`, {args.epochs} epochs, evaluated every "
            f"{args.eval_freq}; seeds {args.seeds}; mean over the seeds that got there.\n\n" + table(rows, args) + "\n")
    (out / "results.md").write_text(text)
    plot(rows, out / "hacking.png")
    first = out / "runs" / f"{args.presets.split(',')[0]}_plain_seed{args.seeds.split(',')[0]}" / "samples"
    for name in ("eval_before.png", f"eval_epoch_{args.epochs - 1:05d}.png"):
        if (first / name).is_file():
            shutil.copy(first / name, out / f"grid_{name}")
    print(text)
    return rows


if __name__ == "__main__":
    main()
