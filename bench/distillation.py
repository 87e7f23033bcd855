"""On-policy distillation from two teachers against GRPO on the sum of their rewards, on the embedded SD model.

    python bench/distillation.py --out DIR --seeds 0,1,2,3,4,5,6,7 --nfe 40960 --teacher-queries 1920 --jobs 2

1. Two teachers, each grpo from the base model on one reward of the same prompts (``--rewards``, default
   shapes_alignment, which wants the caption's shape drawn, and jpeg_compressibility, which wants a plain image), one
   seed each (``--teacher-seed``), ``--teacher-queries`` reward queries: their lora/ exports are the teachers.
2. From the base model, per seed, at equal denoiser evaluations (``--nfe``; the teachers' forwards count, perf/nfe):
   ``grpo_sum``, grpo on the sum of both rewards (``--weights``), and ``opd``, a student distilled from both teachers
   (algorithm.objective=opd, every teacher on every prompt; its rewards are only measured), with ``--opd-set`` for
   its own fields; ``--student "LABEL FIELD=VALUE ..."`` adds a row of opd with those fields, e.g.
   ``--student "opd_mixed opd.reward_weight=1"`` (the mixed mode: the policy loss on the summed reward's advantages
   beside the teachers' KL).

Every run is measured by its evaluations during training (the same prompts and initial noises for every run and seed;
the last evaluation scores the weights the run ends with, chosen on nothing): each reward's gain (last minus first
evaluation) and its share of the gain of that reward's teacher; the summed reward's gain, as the runs train it; the
paired difference opd - grpo_sum per seed with its 95% t interval. Both steps are bench/compare_algorithms.py runs
(its tables and its fresh final evaluation of each run, in DIR/teachers and DIR/students); this writes
DIR/results.{md,json}. Running it again skips the runs already done.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import compare_algorithms  # noqa: E402
from compare_algorithms import difference_interval, mean_std  # noqa: E402


def teacher_label(reward: str) -> str:
    return f"teacher_{reward}"


def train_teachers(args, rewards: list[str]) -> dict[str, dict]:
    """{reward: its teacher's row} after step 1 (module docstring)."""
    variants = [arg for reward in rewards for arg in ("--variant", f"{teacher_label(reward)}=grpo reward_fn={reward}")]
    rows = compare_algorithms.main(["--out", str(Path(args.out) / "teachers"), "--seeds", str(args.teacher_seed),
                                    "--queries", str(args.teacher_queries), "--jobs", str(args.jobs), *variants,
                                    *[a for s in args.set for a in ("--set", s)]])
    return {reward: next(r for r in rows if r["preset"] == teacher_label(reward)) for reward in rewards}


def train_students(args, rewards: list[str], weights: list[float]) -> list[dict]:
    """The rows of step 2 (module docstring)."""
    runs = Path(args.out).resolve() / "teachers" / "runs"
    teachers = {reward: str(runs / f"{teacher_label(reward)}_seed{args.teacher_seed}" / "lora") for reward in rewards}
    summed = json.dumps(dict(zip(rewards, weights)), separators=(",", ":"))
    opd = ["grpo", f"reward_fn={summed}", "algorithm.objective=opd",
           f"opd.teachers={json.dumps(teachers, separators=(',', ':'))}"]
    students = [f"opd={' '.join(opd + args.opd_set)}"]
    for spec in args.student:
        label, *sets = spec.split()
        students.append(f"{label}={' '.join(opd + sets)}")
    return compare_algorithms.main(["--out", str(Path(args.out) / "students"), "--seeds", args.seeds, "--nfe",
                                    str(args.nfe), "--jobs", str(args.jobs), "--versus", "grpo_sum",
                                    "--variant", f"grpo_sum=grpo reward_fn={summed}",
                                    *[a for row in students for a in ("--variant", row)],
                                    *[a for s in args.set for a in ("--set", s)]])


def gain(row: dict, key: str) -> float:
    """A row's gain on ``key`` between its first and last evaluation: a reward's info mean, or "reward" (the trained
    reward's mean); "fresh": the trained reward's change in the fresh final evaluation (images nothing was chosen on)."""
    if key == "fresh":
        return row["fresh"]["change"]
    first, last = row["evaluations"][0], row["evaluations"][-1]
    return (last[key] - first[key]) if key == "reward" else (last["info"][key] - first["info"][key])


def summarise(teachers: dict[str, dict], rows: list[dict], rewards: list[str],
              students: tuple = ("opd",)) -> tuple[str, dict]:
    """The study's table (markdown) and its numbers (``students``: the distilled rows' labels)."""
    labels = ["grpo_sum", *students]
    by_label = {label: sorted((r for r in rows if r["preset"] == label), key=lambda r: r["seed"]) for label in labels}
    # a teacher is trained and evaluated on its own reward only: its gain is its evaluation reward's
    numbers = {"teachers": {reward: {"gain": gain(row, "reward"), "nfe": row["nfe"]} for reward, row in teachers.items()},
               "rows": {}}
    lines = ["| run | seeds | denoiser evaluations | " + " | ".join(
        f"{reward} gain | share of its teacher's" for reward in rewards) + " | summed reward's gain | fresh final "
             "evaluation's |", "|---|---|---|" + "---|---|" * len(rewards) + "---|---|"]
    for reward, row in teachers.items():
        cells = " | ".join(f"{gain(row, 'reward'):+.4f} | 1" if other == reward else "- | -" for other in rewards)
        lines.append(f"| teacher on {reward} (seed {row['seed']}) | 1 | {row['nfe']} | {cells} | - | - |")
    for label in labels:
        rs = by_label[label]
        numbers["rows"][label] = {reward: [gain(r, reward) for r in rs] for reward in rewards}
        numbers["rows"][label]["summed"] = [gain(r, "reward") for r in rs]
        numbers["rows"][label]["fresh"] = [gain(r, "fresh") for r in rs]
        numbers["rows"][label]["nfe"] = [r["nfe"] for r in rs]
        cells = []
        for reward in rewards:
            teacher_gain = gain(teachers[reward], "reward")
            values = [gain(r, reward) for r in rs]
            shares = [v / teacher_gain for v in values] if teacher_gain else []  # a teacher that did not move: none
            cells.append(f"{mean_std(values)} | {mean_std(shares, empty='-')}")
        lines.append(f"| {label} | {len(rs)} | {mean_std([r['nfe'] for r in rs])} | {' | '.join(cells)} | "
                     f"{mean_std(numbers['rows'][label]['summed'])} | {mean_std(numbers['rows'][label]['fresh'])} |")
    names = [*rewards, "summed reward", "summed reward, fresh final evaluation"]
    paired = ["", "| paired by seed | " + " | ".join(f"{name} (95% interval)" for name in names) + " |",
              "|---|" + "---|" * len(names)]
    numbers["paired"] = {}
    for label in students:
        seeds = sorted({r["seed"] for r in by_label[label]} & {r["seed"] for r in by_label["grpo_sum"]})
        numbers["paired"][label] = {}
        cells = []
        for key in [*rewards, "reward", "fresh"]:
            a = [gain(next(r for r in by_label[label] if r["seed"] == s), key) for s in seeds]
            b = [gain(next(r for r in by_label["grpo_sum"] if r["seed"] == s), key) for s in seeds]
            mean, low, high = difference_interval(a, b)
            numbers["paired"][label][key] = {"mean": mean, "low": low, "high": high, "seeds": seeds}
            cells.append(f"{mean:+.4f} ({low:+.4f} .. {high:+.4f})")
        paired.append(f"| {label} - grpo_sum | {' | '.join(cells)} |")
    return "\n".join(lines + paired), numbers


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/distillation")
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    parser.add_argument("--rewards", default="shapes_alignment,jpeg_compressibility")
    parser.add_argument("--weights", default="1,1", help="grpo_sum's weight of each reward")
    parser.add_argument("--teacher-seed", type=int, default=1000)
    parser.add_argument("--teacher-queries", type=int, default=1920)
    parser.add_argument("--nfe", type=int, default=40960, help="denoiser evaluations of each student and grpo_sum run")
    parser.add_argument("--opd-set", action="append", default=[], metavar="FIELD=VALUE", help="the opd row's own fields")
    parser.add_argument("--student", action="append", default=[], metavar='"LABEL FIELD=VALUE ..."',
                        help="another distilled row: opd with these fields")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="every run's fields")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    rewards = args.rewards.split(",")
    weights = [float(w) for w in args.weights.split(",")]
    if len(rewards) != 2 or len(weights) != 2:
        raise SystemExit(f"--rewards {args.rewards!r} and --weights {args.weights!r}: two of each")
    teachers = train_teachers(args, rewards)
    rows = train_students(args, rewards, weights)
    text, numbers = summarise(teachers, rows, rewards, ("opd", *[spec.split()[0] for spec in args.student]))
    print(text)
    out = Path(args.out)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"settings": vars(args), **numbers}, indent=1) + "\n")


if __name__ == "__main__":
    main()
