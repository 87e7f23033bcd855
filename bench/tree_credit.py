"""Where GROUP_PPO on trees puts its credit, against tree_grpo on the same trees, epoch by epoch of a real run.

    python bench/tree_credit.py --preset group_ppo_flow --set group_ppo.value_source=tree --seeds 0,1,2 --jobs 2 \
        --out bench/results/tree_credit

Each seed trains the row as bench/compare_algorithms.py does (the same configuration, seed, number of epochs and, with
the same --jobs, threads: the same run, bit for bit, on one machine) and, on every round's gathered rewards and tree,
also computes what ``--against`` (default tree_grpo) would have given the same rows, without using it. Per epoch and
stochastic step n, for the run's estimator and the other one:

    rms        sqrt(mean_i A_{i,n}^2): the per-row scale of the advantages the loss multiplies
    net        sqrt(mean over transitions of (mean_{i sharing it} A_{i,n})^2): the credit a distinct transition
               x_n -> x_{n+1} gets in all (rows of a tree share the steps before their branch)
    opposed    the share of rows whose A_{i,n} has the sign opposite to their transition's net credit: under PPO's
               clip these rows keep pulling the shared ratio back once it leaves [1 - eps, 1 + eps]

and the run's own metrics (train/clipfrac, segment/tau, segment/num_endpoints, segment/critic_ev, tree/value_ev,
adv/std). Writes per-seed records to ``--out``/credit.json and a table (means over seeds of the epochs' means,
first and second half of the run) to ``--out``/credit.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_algorithms import epochs_for_queries, run_pool, set_field, study_run  # noqa: E402
from config.base import get_config  # noqa: E402
from ddpo_group.algorithms import get_adv_estimator  # noqa: E402
from ddpo_group.rollout.collector import estimate_advantages  # noqa: E402
from ddpo_group.run.persistence.metrics_log import read_metrics  # noqa: E402
from ddpo_group.sampling.window import stochastic_steps  # noqa: E402

RUN_METRICS = ("reward_mean", "train/clipfrac", "train/approx_kl", "segment/tau", "segment/num_endpoints",
               "segment/critic_ev", "tree/value_ev", "adv/std")


def credit(advantages: torch.Tensor, tree_nodes: torch.Tensor, step: int) -> dict:
    """rms, net and opposed (module docstring) of ``advantages`` [B, T] at ``step``."""
    a = advantages[:, step].double()
    transition = tree_nodes[:, step + 1]  # rows reaching the same x_{n+1} took the same transition
    ids, inverse = transition.unique(return_inverse=True)
    net = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, a)
    net = net / torch.bincount(inverse, minlength=len(ids)).double()
    shared = net[inverse]
    opposed = ((a * shared) < 0).double().mean()
    return {"rms": float(a.pow(2).mean().sqrt()), "net": float(net.pow(2).mean().sqrt()), "opposed": float(opposed),
            "transitions": len(ids)}


def run_seed(config, seed: int, against: str, out: Path) -> dict:
    from ddpo_group.run.trainer import Trainer

    config = config.copy_and_resolve_references()
    study_run(config, seed, out / "runs", f"seed{seed}")
    other_config = config.copy_and_resolve_references()
    other_config.algorithm.adv_estimator = against
    other = get_adv_estimator(against)
    steps = stochastic_steps(config.sample).nonzero().flatten().tolist()
    trainer = Trainer(config)
    rollouts = trainer.rollouts
    own_estimate = rollouts.estimate_round
    records = []

    def estimate_round(r):
        r = own_estimate(r)
        inputs = r.advantage_inputs(r.batch.num_steps)
        theirs = estimate_advantages(other, other_config, inputs).advantages
        nodes = inputs.tree_nodes
        records.append({str(n): {"own": credit(r.out.advantages, nodes, n), "other": credit(theirs, nodes, n)}
                        for n in steps})
        return r

    rollouts.estimate_round = estimate_round
    trainer.run()
    epochs = list(read_metrics(trainer.run_dir / "metrics.jsonl"))
    per_round = max(1, len(records) // max(1, len(epochs)))
    for i, m in enumerate(epochs):  # the rounds of an epoch averaged (one round an epoch without dynamic sampling)
        rounds = records[i * per_round:(i + 1) * per_round]
        m["credit"] = {n: {side: {k: sum(r[n][side][k] for r in rounds) / len(rounds) for k in rounds[0][n][side]}
                           for side in ("own", "other")} for n in rounds[0]}
    return {"seed": seed, "epochs": [{"epoch": m["epoch"], "credit": m["credit"],
                                      **{k: m.get(k) for k in RUN_METRICS}} for m in epochs]}


def mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def table(seeds: list[dict], own: str, against: str) -> str:
    """The markdown table of credit.md: per half of the run, each step's rms / net / opposed (``own`` / ``against``)
    and the run's metrics, each the mean over seeds of the half's epoch means."""
    halves = {}
    for s in seeds:
        n = len(s["epochs"])
        halves.setdefault("first half", []).append(s["epochs"][:n // 2])
        halves.setdefault("second half", []).append(s["epochs"][n // 2:])
    steps = list(seeds[0]["epochs"][0]["credit"])
    head = ("| epochs | " + " | ".join(f"step {n}: {k} ({own} / {against})"
                                      for n in steps for k in ("rms", "net", "opposed"))
            + " | " + " | ".join(RUN_METRICS) + " |")
    lines = [head, "|" + "---|" * (1 + 3 * len(steps) + len(RUN_METRICS))]
    for label, per_seed in halves.items():
        cells = []
        for n in steps:
            for k in ("rms", "net", "opposed"):
                o = mean(mean(e["credit"][n]["own"][k] for e in eps) for eps in per_seed)
                t = mean(mean(e["credit"][n]["other"][k] for e in eps) for eps in per_seed)
                cells.append(f"{o:.3f} / {t:.3f}")
        cells += [f"{mean(mean(e[k] for e in eps) for eps in per_seed):.3g}" for k in RUN_METRICS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="group_ppo_flow", help="a preset or recipe (config/base.py, config/recipes.py)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="overrides, as bench/compare_algorithms.py's (default: group_ppo.value_source=tree)")
    p.add_argument("--against", default="tree_grpo", help="the estimator computed beside the run's own")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--queries", type=int, default=1280, help="reward queries a run (as compare_algorithms')")
    p.add_argument("--eval-freq", type=int, default=5)
    p.add_argument("--out", default="bench/results/tree_credit")
    p.add_argument("--jobs", type=int, default=1,
                   help="seeds at once, each in its own process with cpu_count // jobs threads (1: in this process)")
    args = p.parse_args(argv)
    config = get_config(args.preset)
    for item in ["device=cpu", f"eval_freq={args.eval_freq}"] + (args.set or ["group_ppo.value_source=tree"]):
        key, _, raw = item.partition("=")
        set_field(config, key, raw)
    config.num_epochs = epochs_for_queries(config, args.queries)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with run_pool(args.jobs) as pool:
        seeds = [int(s) for s in args.seeds.split(",") if s]
        if pool:
            seeds = list(pool.map(run_seed, *zip(*[(config, seed, args.against, out) for seed in seeds])))
        else:
            seeds = [run_seed(config, seed, args.against, out) for seed in seeds]
    (out / "credit.json").write_text(json.dumps({"preset": args.preset, "set": args.set, "against": args.against,
                                                 "seeds": seeds}, indent=1))
    text = table(seeds, config.algorithm.adv_estimator, args.against)
    (out / "credit.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
