"""The guard's rules (ddpo_group/run/guard.py) on runs that should not raise them and on runs that should: per rule,
how many runs it fires on, and how close each run comes to each threshold.

    python bench/guard_calibration.py --out docs/studies/guard --presets group_ppo --seeds 42,43,44,45,46,47,48,49 --jobs 2
    python bench/guard_calibration.py --out docs/studies/guard --replay docs/studies/hacking/runs

The first trains each preset's default run (the README's: the embedded model, its own reward, its evaluation every
``eval_freq`` epochs; ``--train-set FIELD=VALUE`` changes a field) on each seed, then reads its eval.jsonl; ``--replay DIR`` reads the runs already in DIR (each
run directory with an eval.jsonl, e.g. bench/reward_hacking.py's) and trains nothing. Per run, with the guard's
defaults (config/base.py) or ``--set guard.FIELD=VALUE``:

    fired       the rules that raise their alarm, with the epoch
    drift       the largest |eval/drift/<statistic>| over the evaluations, in units of that statistic's spread over the
                images before training (the drift rule's measure; it fires above guard.max_drift); the JSON also holds
                each evaluation's largest (``drift_by_evaluation``, at ``epochs``)
    fall        the largest drop of the trained reward's evaluation below its best so far, in its standard errors, at an
                evaluation below the value before training (the fall rule's measure; it fires above guard.fall_drop)
    diversity   the lowest eval/diversity over its value before training (it fires below guard.min_diversity)
    verdict     what the run handed over, by its fresh final evaluation (summary.json, run/reporting/verdict.py):
                learned, did_not_learn, fell or hacked, with the change on fresh images and its standard error, the
                best evaluation's (lora_best/) change, and the restores

Writes <out>/<name>.json, <out>/<name>.md and prints the table and, per preset, the fresh final evaluation's counts:
runs below their start, "did not learn", restores (<name>: "default", or the replayed study's name: the directory's,
or its parent's for a directory named runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_algorithms import fresh_table, handed_over, set_field  # noqa: E402
from config.base import get_config  # noqa: E402
from ddpo_group.run.guard import Guard, standard_error  # noqa: E402

POINTWISE = "eval/reward_info/score"  # a groupwise reward's declared pointwise score (rewards/base.py), when logged


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where the results go (the trained runs: <out>/runs/)")
    p.add_argument("--presets", default="group_ppo")
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each")
    p.add_argument("--replay", default="", help="read the runs in this directory instead of training")
    p.add_argument("--set", action="append", default=[], help="guard.FIELD=VALUE for the replayed guard")
    p.add_argument("--train-set", action="append", default=[], help="FIELD=VALUE for every trained run")
    return p.parse_args(argv)


def train(out: Path, preset: str, seed: int, extra: list) -> Path:
    run_dir = out / "runs" / f"{preset}_seed{seed}"
    if (run_dir / "summary.json").is_file():  # a finished run is kept (a stopped one has summary.txt only)
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", f"{ROOT / 'config' / 'base.py'}:{preset}",
               f"--config.seed={seed}", "--config.num_cpu_threads=1", "--config.device=cpu",
               "--config.wandb.mode=disabled", "--config.save_freq=0", f"--config.logdir={run_dir.parent}",
               f"--config.run_name={run_dir.name}", *[f"--config.{item}" for item in extra]]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed (exit {done.returncode}): see {run_dir.parent / run_dir.name}.log")
    return run_dir


def margins(records: list[dict], guard_config) -> dict:
    """One run's evaluations replayed through the guard: the rules fired and each rule's measure (module docstring)."""
    start = records[0]
    rising = POINTWISE if f"{POINTWISE}_std" in start else "eval/reward_mean"
    guard, fired = Guard(guard_config, heldout="eval_heldout/reward_mean" in start, rising=rising), {}
    drift, fall, peak, drifts = (0.0, ""), 0.0, None, []
    for record in records:
        for alarm in guard.observe(record["epoch"], record)[1]:
            fired.setdefault(alarm.rule, record["epoch"])
        drifts.append(0.0)
        for key, value in record.items():
            spread = start.get(f"eval/image_spread/{key.rsplit('/', 1)[1]}") if key.startswith("eval/drift/") else None
            if spread:
                drifts[-1] = max(drifts[-1], abs(value) / spread)
            if spread and abs(value) / spread > drift[0]:
                drift = (abs(value) / spread, key.rsplit("/", 1)[1])
        value = record[rising]
        if peak is not None and value < start[rising]:
            fall = max(fall, (peak[0] - value) / max(peak[1], 1e-12))
        if peak is None or value > peak[0]:
            peak = (value, standard_error(record, rising))
    diversity = [r["eval/diversity"] / start["eval/diversity"] for r in records if start.get("eval/diversity")]
    return {"fired": fired, "drift": round(drift[0], 3), "drift_statistic": drift[1], "fall_se": round(fall, 2),
            "diversity": round(min(diversity), 3) if diversity else None, "rising": rising,
            "epochs": [r["epoch"] for r in records], "drift_by_evaluation": [round(d, 3) for d in drifts]}


def table(runs: dict) -> str:
    fresh = any(m.get("verdict") for m in runs.values())
    lines = ["| run | fired (epoch) | largest drift (spreads) | largest fall (SE, below start) | lowest diversity |"
             + (" verdict | fresh change (SE) | lora_best/ change (epoch) | restores (after -> to) |" if fresh else ""),
             "|---|---|---|---|---|" + ("---|---|---|---|" if fresh else "")]
    for name, m in runs.items():
        fired = ", ".join(f"{rule} ({epoch})" for rule, epoch in m["fired"].items()) or "none"
        row = (f"| {name} | {fired} | {m['drift']:.2f} ({m['drift_statistic']}) | {m['fall_se']:.2f} | "
               f"{m['diversity']} |")
        if fresh and m.get("verdict"):
            best = f"{m['best_change']:+.4f} ({m['best_epoch']})" if m["best_change"] is not None else "—"
            restores = ", ".join(f"{r['after_epoch']} -> {r['to_epoch']}" for r in m["restores"]) or "none"
            row += f" {m['verdict']} | {m['change']:+.4f} ({m['se']:.4f}) | {best} | {restores} |"
        lines.append(row)
    rules = sorted({rule for m in runs.values() for rule in m["fired"]})
    count = ", ".join(f"{rule} {sum(rule in m['fired'] for m in runs.values())}" for rule in rules) or "none"
    text = "\n".join(lines) + f"\n\nRuns: {len(runs)}; runs each rule fired on: {count}.\n"
    if not fresh:
        return text
    presets = list(dict.fromkeys(name.rsplit("_seed", 1)[0] for name in runs))  # a run's name less its _seed<N>
    rows = [{"preset": name.rsplit("_seed", 1)[0], "fresh": m} for name, m in runs.items() if m.get("verdict")]
    return text + "\n" + fresh_table(rows, presets) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    config = get_config("group_ppo")
    for item in args.set:
        set_field(config, *item.split("=", 1))
    guard_config = config.guard
    if args.replay:
        replay = Path(args.replay)  # named for the study: docs/studies/hacking/runs -> hacking
        name = replay.parent.name if replay.name == "runs" else replay.name
        run_dirs = sorted(p.parent for p in replay.glob("*/eval.jsonl"))
    else:
        name = "default"
        jobs = [(preset, seed) for preset in args.presets.split(",") for seed in map(int, args.seeds.split(","))]
        with ThreadPoolExecutor(args.jobs) as pool:
            run_dirs = list(pool.map(lambda job: train(out, *job, args.train_set), jobs))
    runs = {d.name: {**margins([json.loads(line) for line in (d / "eval.jsonl").read_text().splitlines()],
                               guard_config), **handed_over(d)}
            for d in run_dirs}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"guard": guard_config.to_dict(), "runs": runs}, indent=1))
    text = table(runs)
    (out / f"{name}.md").write_text(text)
    print(text)
    return runs


if __name__ == "__main__":
    main()
