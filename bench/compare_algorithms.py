"""Learning proof: every preset trained for the same number of reward queries, several seeds each.

    python bench/compare_algorithms.py --presets ddpo,grpo,group_ppo --seeds 0,1,2 --queries 1280 --threshold 0.88

Each (preset, seed) run is the preset's configuration (``--set FIELD=VALUE`` overrides any field) with ``num_epochs``
set to spend ``--queries`` reward queries (ReMax's greedy samples and GROUP_PPO's Tweedie values included), or with
``--nfe`` instead to spend that many denoiser evaluations (perf/nfe: forwards and backwards, CFG's rows counted; a
one-epoch probe run measures a row's evaluations per epoch). A
``--variant "LABEL=PRESET FIELD=VALUE ..."`` adds a row: a preset with overrides of its own, e.g.

    --variant "group_ppo_tweedie=group_ppo group_ppo.value_source=tweedie"

and ``--set pretrained.model=tiny-shapes-flow`` runs every row on the embedded flow-matching model. The model is
measured by the run's own evaluation during training (``eval_freq``, ddpo_group/run/periodic_eval.py): the same prompts from the same initial
noise with the deterministic sampler, before the first update and every ``eval_freq`` epochs, read from the run's
eval.jsonl. Reported per preset (mean +- std over seeds): the evaluation reward before and after, the gain, with the
shapes_alignment reward the joint accuracy (every attribute right) before and after, the queries spent, the queries
until the evaluation reward first reached ``--threshold`` (a number, or a row's label: the mean final evaluation
reward of that row), with a critic its explained variance over the last 10 epochs, the denoiser evaluations spent, the
evaluation reward's gain at equal denoiser evaluations (each row's last evaluation within ``--at-nfe``, default the
fewest any row spent) and the evaluations until ``--threshold``, and the wall time. Prints a markdown table, writes it
with the raw rows to ``--out``/results.{md,json} and plots evaluation reward against queries and against denoiser
evaluations, and the epoch-mean reward against queries, to ``--out``/reward_vs_queries.png (the plotted curves in
reward_vs_queries.json). A table of what the runs handed over follows (their fresh final evaluation, summary.json: the gain on images nothing
was chosen on, the runs below their start, the verdicts, the restores). ``--versus LABEL`` adds a table of every row's
difference to that row (the gain after the
budget and at equal evaluations, mean over seeds) with its 95% t interval, paired by seed (a seed's evaluation is the
same for every row): a difference whose interval holds 0 is within the seeds' noise. No accelerate launch
needed: runs in this process, or ``--jobs N`` at once in worker processes (each with cpu_count // N threads). Every
finished run is saved at once; running the same command again (or with more presets, variants or seeds) skips the
runs already in ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config.base import PRESETS, get_config  # noqa: E402
from config.recipes import RECIPES  # noqa: E402
from ddpo_group.algorithms import get_adv_estimator  # noqa: E402
from ddpo_group.run.reporting.epoch_logger import EVAL_LOG  # noqa: E402
from ddpo_group.run.periodic_eval import PROMPT_GROUP  # noqa: E402
from ddpo_group.run.persistence.metrics_log import read_metrics  # noqa: E402
from ddpo_group.run.command.renamed_fields import new_name, notice  # noqa: E402
from ddpo_group.rollout.tweedie import valued_steps  # noqa: E402
from ddpo_group.sampling.window import stochastic_steps  # noqa: E402

PROMPT_KEY = "eval/" + PROMPT_GROUP  # a prompt's mean reward in an evaluation record
INFO_KEY = "eval/reward_info/"  # the reward's info means in an evaluation record


def set_field(config, key: str, raw: str) -> None:
    """``config``'s field ``key`` (a former name is renamed, saying so) set from the text ``raw`` as its type."""
    if (renamed := new_name(key)) is not None:
        print(notice(key, renamed), file=sys.stderr)
        key = renamed
    section, _, field = key.rpartition(".")
    target = config
    for part in section.split(".") if section else []:
        if part not in target:
            raise SystemExit(f"{key}={raw}: config has no section {part!r}")
        target = target[part]
    if field not in target and not section.endswith("_kwargs"):
        raise SystemExit(f"{key}={raw}: config has no field {key!r} (docs/configuration.md lists them)")
    current = target[field] if field in target else ""  # a new key of a *_kwargs section: a string
    if field in target and target.get_type(field) is object:  # e.g. compile_denoiser: False / "regional" / "auto"
        try:  # as ml_collections' command line reads such a field
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
    elif isinstance(current, bool):
        value = raw.lower() in ("1", "true", "yes")
    elif isinstance(current, tuple):  # e.g. sample.branch_steps=(0,1), or =1 for (1,)
        parsed = ast.literal_eval(raw) if raw.strip("() ") else ()
        value = tuple(parsed) if isinstance(parsed, (tuple, list)) else (parsed,)
    elif isinstance(current, int):
        value = int(raw)
    elif isinstance(current, float) or current is None:
        value = float(raw)
    else:
        value = raw
    target[field] = value


def evaluation_curve(run_dir: Path, queries_after_epoch: dict[int, tuple[int, int]]) -> list[dict]:
    """The run's evaluations (eval.jsonl) as [{"epoch", "queries", "nfe", "reward", "accuracy", "prompts"}], oldest
    first; reward queries and denoiser evaluations spent before each (``queries_after_epoch``: epoch -> both; 0 for the
    one before the first update); accuracy None for rewards without ``all_correct``; prompts: each evaluation prompt's
    mean reward (a run that loses one prompt while it gains on the others shows it there); info: the reward's info
    means (a combination's components under their labels)."""
    out = []
    for record in read_metrics(run_dir / EVAL_LOG):
        queries, nfe = queries_after_epoch.get(record["epoch"], (0, 0))
        prompts = {key.removeprefix(PROMPT_KEY): value for key, value in record.items() if key.startswith(PROMPT_KEY)}
        info = {key.removeprefix(INFO_KEY): value for key, value in record.items() if key.startswith(INFO_KEY)}
        out.append({"epoch": record["epoch"], "queries": queries, "nfe": nfe, "reward": record["eval/reward_mean"],
                    "accuracy": record.get("eval/reward_info/all_correct"), "prompts": prompts, "info": info})
    return out


def parse_variants(presets: list[str], variants: list[str]) -> dict[str, tuple[str, list[str]]]:
    """label -> (preset, its FIELD=VALUE overrides): each preset of --presets as itself, then each --variant."""
    out = {preset: (preset, []) for preset in presets}
    for spec in variants:
        head, *sets = spec.split()
        label, _, preset = head.partition("=")
        if not label or (preset not in PRESETS and preset not in RECIPES) or any("=" not in s for s in sets):
            raise SystemExit(f"--variant {spec!r}: expected 'LABEL=PRESET FIELD=VALUE ...' with a preset of "
                             f"{sorted(PRESETS)} or a recipe of {sorted(RECIPES)}")
        out[label] = (preset, sets)
    return out


def run_one(label: str, seed: int, args) -> dict:
    from ddpo_group.run.trainer import Trainer  # imported by the first run: a refused command line answers at once

    preset, own = args.variants[label]
    config = get_config(preset)
    for item in args.set + own:
        key, _, raw = item.partition("=")
        set_field(config, key, raw)
    if not config.eval_freq:
        raise SystemExit("the study measures with the run's evaluation during training: eval_freq must be > 0")
    study_run(config, seed, Path(args.out) / "runs", f"{label}_seed{seed}")
    config.num_epochs = (epochs_for_queries(config, args.queries) if args.nfe is None
                         else epochs_for_nfe(config, args.nfe))
    start = time.perf_counter()
    trainer = Trainer(config)
    trainer.run()
    wall = time.perf_counter() - start
    queries, nfe, curve, spent, ev, tree_ev = 0, 0, [], {}, [], []
    for m in read_metrics(trainer.run_dir / "metrics.jsonl"):
        queries += m["reward_queries"]
        nfe += m["perf/nfe"]
        curve.append((queries, m["reward_mean"]))
        spent[m["epoch"]] = (queries, nfe)
        for key, kept in (("segment/critic_ev", ev), ("tree/value_ev", tree_ev)):
            if m.get(key) is not None and math.isfinite(m[key]):
                kept.append(m[key])
    evaluations = evaluation_curve(trainer.run_dir, spent)
    return {"preset": label, "definition": [preset, *own], "seed": seed,
            "critic_ev": sum(ev[-10:]) / len(ev[-10:]) if ev else None,
            "tree_value_ev": sum(tree_ev) / len(tree_ev) if tree_ev else None,
            "before": evaluations[0]["reward"], "after": evaluations[-1]["reward"],
            "accuracy_before": evaluations[0]["accuracy"], "accuracy_after": evaluations[-1]["accuracy"],
            "queries": queries, "nfe": nfe, "wall_s": wall, "curve": curve, "evaluations": evaluations,
            "fresh": handed_over(trainer.run_dir)}


def handed_over(run_dir: Path) -> dict:
    """The run's summary.json, as the table reads it: the verdict, the fresh change of lora/ and of lora_best/ with their
    standard errors, the restores; {} for a run without one."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    reward = record["fresh"].get("reward", {})
    final, best = reward.get("final", {}), reward.get("best", {})
    return {"verdict": record["verdict"], "before": final.get("before"), "after": final.get("after"),
            "change": final.get("change"), "se": final.get("se"), "best_epoch": best.get("epoch"),
            "best_change": best.get("change"), "best_se": best.get("se"), "restores": record["restores"],
            "per_prompt": final.get("per_prompt", {})}


def fresh_table(rows: list[dict], presets: list[str]) -> str:
    """Per row, what its runs handed over by their fresh final evaluation (``rows``' "fresh": handed_over's): the fresh
    gain, the lowest, the runs below their start, each verdict, the runs restored; "" when no run has one."""
    if not any(r.get("fresh") for r in rows):
        return ""
    out = ["| handed over | runs | fresh gain (lora/ vs the base model, images nothing was chosen on) | lowest | "
           "below start | learned | did not learn | fell | hacked | restored |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for preset in presets:
        rs = [r["fresh"] for r in rows if r["preset"] == preset and r.get("fresh")]
        count = {v: sum(r["verdict"] == v for r in rs) for v in ("learned", "did_not_learn", "fell", "hacked")}
        out.append(f"| {preset} | {len(rs)} | {mean_std([r['change'] for r in rs])} | "
                   f"{min((r['change'] for r in rs), default=float('nan')):+.4f} | {sum(r['change'] < 0 for r in rs)} | "
                   f"{count['learned']} | {count['did_not_learn']} | {count['fell']} | {count['hacked']} | "
                   f"{sum(bool(r['restores']) for r in rs)} |")
    return "\n".join(out)


def study_run(config, seed: int, logdir: Path, run_name: str) -> None:
    """``config`` as a study's run: ``seed``, no wandb, no checkpoints or image logs, in ``logdir``/``run_name``, which
    is emptied (a run cut short in an earlier attempt is not resumed: its metrics would add up)."""
    config.seed = seed
    config.wandb.mode = "disabled"
    config.save_freq = 0
    config.log_images_every = 0
    config.logdir = str(logdir)
    config.run_name = run_name
    shutil.rmtree(Path(config.logdir) / config.run_name, ignore_errors=True)


def epochs_for_queries(config, queries: int) -> int:
    """The epochs that spend at most ``queries`` reward queries (at least one), counting ReMax's greedy queries and
    GROUP_PPO's Tweedie values."""
    samples = config.sample.batch_size * config.sample.num_batches_per_epoch
    estimator = get_adv_estimator(config.algorithm.adv_estimator)
    per_epoch = samples
    if estimator.needs_greedy_rewards:  # ReMax: one greedy query per group
        per_epoch += samples // config.train.group_size
    if estimator.reads(config, "tweedie_values"):  # GROUP_PPO's Tweedie values: one query per sample and valued step
        # (the SDE window's steps; a CPS flow's last step, never stochastic, is not subtracted: the queries column
        # reports what the run really spent)
        per_epoch += samples * len(valued_steps(stochastic_steps(config.sample)))
    return max(1, queries // per_epoch)


def epochs_for_nfe(config, budget: int) -> int:
    """The epochs that spend about ``budget`` denoiser evaluations (at least one): ``budget`` over the perf/nfe of a
    one-epoch probe run of ``config`` (no evaluation; its directory removed after). An epoch 0 unlike the others
    sizes it off: the memory probe's trial forwards (train.pairs_per_forward="auto" on CUDA), a critic warm-up
    (critic.warmup_epochs: no update); the runs' own perf/nfe columns say what they spent."""
    from ddpo_group.run.trainer import Trainer

    probe = config.copy_and_resolve_references()
    probe.num_epochs, probe.eval_freq, probe.run_name = 1, 0, config.run_name + "_nfe_probe"
    run_dir = Path(probe.logdir) / probe.run_name
    shutil.rmtree(run_dir, ignore_errors=True)
    Trainer(probe).run()
    (first,) = read_metrics(run_dir / "metrics.jsonl")
    shutil.rmtree(run_dir, ignore_errors=True)
    return max(1, round(budget / first["perf/nfe"]))


def queries_to_reach(evaluations: list[dict], threshold, spent: str = "queries") -> int | None:
    """Reward queries (``spent="nfe"``: denoiser evaluations) spent until the evaluation reward first reached
    ``threshold`` (None: never, or no threshold)."""
    if threshold is None:
        return None
    return next((e[spent] for e in evaluations if e["reward"] >= threshold), None)


def reward_at_nfe(evaluations: list[dict], nfe: int) -> tuple[float, int]:
    """(reward, its denoiser evaluations) of the last evaluation that had spent at most ``nfe``."""
    last = [e for e in evaluations if e["nfe"] <= nfe][-1]
    return last["reward"], last["nfe"]


def load_rows(path: Path, settings: dict) -> list[dict]:
    """The runs already in ``path`` (a study interrupted or run in parts); they must share ``settings``."""
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    if any("nfe" not in row for row in saved.get("rows", [])):
        raise SystemExit(f"{path} holds runs saved before denoiser evaluations were counted: use another --out")
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


def mean_std(values, empty: str = "never"):
    values = [v for v in values if v is not None]
    if not values:
        return empty
    t = torch.tensor(values, dtype=torch.float64)
    std = float(t.std(unbiased=False)) if len(values) > 1 else 0.0
    return f"{float(t.mean()):.4g} ± {std:.2g}"


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom: its density integrated numerically
    (trapezoids on [0, x]) and the integral's inverse found by bisection (no scipy in the install)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        grid = torch.linspace(0.0, x, 4001, dtype=torch.float64)
        density = torch.exp(log_c - (df + 1) / 2 * torch.log1p(grid ** 2 / df))
        return 0.5 + float(torch.trapezoid(density, grid))

    low, high = 0.0, 100.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def difference_interval(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean(a) - mean(b), the ``level`` t interval's low and high end) of paired values: a[i] and b[i] come from the
    same seed (whose evaluation both rows share: the same prompts and initial noises), so the interval is the per-seed
    differences' (n - 1 degrees of freedom)."""
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    diff, se = float(d.mean()), float(d.std()) / math.sqrt(len(a))
    half = t_quantile(0.5 + level / 2, len(a) - 1) * se if se else 0.0
    return diff, diff - half, diff + half


def versus_table(rows: list[dict], presets: list[str], versus: str, at_nfe: int | None = None) -> str:
    """Each row's difference to row ``versus`` (mean over the seeds, with its 95% t interval paired by seed): the
    evaluation reward's gain after the whole budget and at equal denoiser evaluations (as the main table's column)."""
    at_nfe = at_nfe if at_nfe is not None else min((r["nfe"] for r in rows), default=0)

    def gains(preset):
        rs = sorted((r for r in rows if r["preset"] == preset), key=lambda r: r["seed"])
        return ([r["seed"] for r in rs], [r["after"] - r["before"] for r in rs],
                [reward_at_nfe(r["evaluations"], at_nfe)[0] - r["before"] for r in rs])

    if not any(r["preset"] == versus for r in rows):
        raise SystemExit(f"--versus {versus!r}: not a row of this study ({presets})")
    base_seeds, base_final, base_equal = gains(versus)
    out = [f"| variant | seeds | gain - {versus}'s (95% interval) | at {at_nfe} evaluations (95% interval) |",
           "|---|---|---|---|"]
    for preset in presets:
        seeds, final, equal = gains(preset)
        if preset == versus or len(final) < 2 or len(base_final) < 2:
            continue
        if seeds != base_seeds:  # every row runs every seed of the command: only a study cut short differs
            raise SystemExit(f"--versus {versus!r}: {preset} ran seeds {seeds}, {versus} {base_seeds}")
        cells = [difference_interval(x, y) for x, y in ((final, base_final), (equal, base_equal))]
        out.append(f"| {preset} | {len(final)} | " +
                   " | ".join(f"{d:+.4f} ({low:+.4f} to {high:+.4f})" for d, low, high in cells) + " |")
    return "\n".join(out)


def resolve_threshold(threshold: str | None, rows: list[dict]) -> tuple[float | None, str]:
    """(level, its description): a number, or a row label's mean final evaluation reward."""
    if threshold is None:
        return None, "none"
    try:
        return float(threshold), threshold
    except ValueError:
        finals = [r["after"] for r in rows if r["preset"] == threshold]
        if not finals:
            raise SystemExit(f"--threshold {threshold!r}: neither a number nor a row of this study")
        level = sum(finals) / len(finals)
        return level, f"{threshold}'s final {level:.4f}"


def table(rows: list[dict], presets: list[str], threshold: str | None, at_nfe: int | None = None) -> str:
    threshold, described = resolve_threshold(threshold, rows)
    at_nfe = at_nfe if at_nfe is not None else min((r["nfe"] for r in rows), default=0)
    with_accuracy = any(r.get("accuracy_before") is not None for r in rows)
    with_ev = any(r.get("critic_ev") is not None for r in rows)
    with_tree_ev = any(r.get("tree_value_ev") is not None for r in rows)
    accuracy_head = " joint accuracy before | joint accuracy after |" if with_accuracy else ""
    head = (f"| variant | reward before | reward after | gain |{accuracy_head} reward queries | "
            f"queries to reach {described} | denoiser evaluations | evaluations to reach {described} | "
            f"gain at {at_nfe} evaluations (read at) |{' critic EV (last 10 epochs) |' if with_ev else ''}"
            f"{' tree value EV (all epochs) |' if with_tree_ev else ''} wall time (s) |\n"
            f"|---|---|---|---|{'---|---|' if with_accuracy else ''}---|---|---|---|---|{'---|' if with_ev else ''}"
            f"{'---|' if with_tree_ev else ''}---|")
    out = [head]

    def reach(spent: str, rs: list[dict]) -> str:
        reached = [queries_to_reach(r["evaluations"], threshold, spent) for r in rs]
        return mean_std(reached) + (f" ({sum(x is not None for x in reached)}/{len(rs)} seeds)" if rs else "")

    for preset in presets:
        rs = [r for r in rows if r["preset"] == preset]
        accuracy = (f" {mean_std([r.get('accuracy_before') for r in rs])} | {mean_std([r.get('accuracy_after') for r in rs])} |"
                    if with_accuracy else "")
        equal = [reward_at_nfe(r["evaluations"], at_nfe) for r in rs]
        out.append(
            f"| {preset} | {mean_std([r['before'] for r in rs])} | {mean_std([r['after'] for r in rs])} | "
            f"{mean_std([r['after'] - r['before'] for r in rs])} |{accuracy} {mean_std([r['queries'] for r in rs])} | "
            f"{reach('queries', rs)} | {mean_std([r['nfe'] for r in rs])} | {reach('nfe', rs)} | "
            f"{mean_std([reward - r['before'] for (reward, _), r in zip(equal, rs)])} "
            f"({mean_std([spent for _, spent in equal])}) |"
            f"{' ' + mean_std([r.get('critic_ev') for r in rs], empty='—') + ' |' if with_ev else ''}"
            f"{' ' + mean_std([r.get('tree_value_ev') for r in rs], empty='—') + ' |' if with_tree_ev else ''} "
            f"{mean_std([r['wall_s'] for r in rs])} |"
        )
    return "\n".join(out)


def moving_average(values: torch.Tensor, window: int) -> torch.Tensor:
    """Mean of the last ``window`` values at each position (fewer at the start), along the last dimension."""
    cumsum = torch.nn.functional.pad(values.cumsum(-1), (1, 0))
    ends = torch.arange(1, values.shape[-1] + 1)
    starts = (ends - window).clamp(min=0)
    return (cumsum[..., ends] - cumsum[..., starts]) / (ends - starts)


def plot(rows: list[dict], presets: list[str], path: Path, smooth: int = 5) -> None:
    """Left: the evaluation reward against queries (mean over seeds, the seeds' spread shaded); middle: the same against
    denoiser evaluations; right: the epoch-mean reward of the training prompts (moving average over ``smooth``
    epochs), which moves with the drawn prompts. The plotted curves are written beside the figure (``path`` as .json):
    per row, {"evaluation": {"queries", "nfe", "reward_mean", "reward_std"}, "training": {"queries",
    "reward_moving_average"}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(19, 5))
    curves = {}
    for preset in presets:
        runs = [r for r in rows if r["preset"] == preset]
        if not runs:
            continue
        width = 2 if preset in ("ddpo", "grpo", "group_ppo") else 1
        n = min(len(r["evaluations"]) for r in runs)
        queries = [runs[0]["evaluations"][i]["queries"] for i in range(n)]
        ys = torch.tensor([[r["evaluations"][i]["reward"] for i in range(n)] for r in runs], dtype=torch.float64)
        mean, std = ys.mean(0), ys.std(0, unbiased=False)
        line, = left.plot(queries, mean.tolist(), marker="o", markersize=3, label=preset, linewidth=width)
        left.fill_between(queries, (mean - std).tolist(), (mean + std).tolist(), alpha=0.12, color=line.get_color())
        nfe = [sum(r["evaluations"][i]["nfe"] for r in runs) / len(runs) for i in range(n)]  # the seeds' mean
        middle.plot(nfe, mean.tolist(), marker="o", markersize=3, label=preset, linewidth=width, color=line.get_color())
        middle.fill_between(nfe, (mean - std).tolist(), (mean + std).tolist(), alpha=0.12, color=line.get_color())
        n = min(len(r["curve"]) for r in runs)
        epoch_queries = [runs[0]["curve"][i][0] for i in range(n)]
        smoothed = moving_average(torch.tensor([[r["curve"][i][1] for i in range(n)] for r in runs],
                                               dtype=torch.float64), smooth).mean(0)
        right.plot(epoch_queries, smoothed.tolist(), label=preset, linewidth=width, color=line.get_color())
        curves[preset] = {"evaluation": {"queries": queries, "nfe": nfe, "reward_mean": mean.tolist(),
                                         "reward_std": std.tolist()},
                          "training": {"queries": epoch_queries, "reward_moving_average": smoothed.tolist()}}
    left.set_title("fixed evaluation (deterministic sampler), mean of seeds")
    middle.set_title("the same against denoiser evaluations (forward + backward)")
    middle.set_xlabel("denoiser evaluations")
    for ax in (left, middle):
        ax.set_ylabel("evaluation reward")
    right.set_title(f"training epochs (moving average over {smooth})")
    right.set_ylabel("epoch-mean reward")
    for ax in (left, right):
        ax.set_xlabel("reward queries")
    left.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    path.with_suffix(".json").write_text(json.dumps(curves, indent=1))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=None, help="comma-separated presets (default: all, or none with --variant)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--queries", type=int, default=1280, help="reward queries per run (1280: 40 epochs of 32)")
    parser.add_argument("--nfe", type=int, default=None,
                        help="denoiser evaluations per run instead of --queries (perf/nfe; a probe epoch sizes it)")
    parser.add_argument("--at-nfe", type=int, default=None,
                        help="the equal-evaluations column's level (default: the fewest evaluations of any run)")
    parser.add_argument("--threshold", default=None,
                        help="evaluation reward level for 'queries to reach': a number or a row's label (its final)")
    parser.add_argument("--versus", default=None,
                        help="a row's label: a second table of every row's difference to it, with 95%% intervals")
    parser.add_argument("--variant", action="append", default=[], metavar='"LABEL=PRESET FIELD=VALUE ..."',
                        help="a row of its own: a preset with overrides")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in its own process with cpu_count // jobs threads (1: in this process)")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.presets is None:
        args.presets = "" if args.variant else ",".join(PRESETS)
    args.variants = parse_variants([p for p in args.presets.split(",") if p], args.variant)
    presets = list(args.variants)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"queries": args.queries, "set": sorted(args.set)} if args.nfe is None else \
        {"nfe": args.nfe, "set": sorted(args.set)}
    rows = load_rows(out / "results.json", settings)
    for row in rows:  # a label saved with another definition is another row: refused, not mixed in
        preset, own = args.variants.get(row["preset"], (None, None))
        if preset is not None and row.get("definition", [row["preset"]]) != [preset, *own]:
            raise SystemExit(f"{out / 'results.json'} holds {row['preset']!r} as {row.get('definition')}, not "
                             f"{[preset, *own]}: use another label or --out")
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
                  f"queries, {row['nfe']} denoiser evaluations, {row['wall_s']:.0f}s", flush=True)
    rows = [r for r in rows if r["preset"] in presets and r["seed"] in seeds]
    rows.sort(key=lambda r: (presets.index(r["preset"]), r["seed"]))
    text = table(rows, presets, args.threshold, args.at_nfe)
    if args.versus is not None:
        text += "\n\n" + versus_table(rows, presets, args.versus, args.at_nfe)
    if fresh := fresh_table(rows, presets):
        text += "\n\n" + fresh
    print(text)
    (out / "results.md").write_text(text + "\n")
    plot(rows, presets, out / "reward_vs_queries.png")
    return rows


if __name__ == "__main__":
    main()
