"""The trained sampler against the pipelines' multistep solvers, on adapters trained with it.

    python bench/compare_algorithms.py --presets grpo_flow --seeds 0,1,2,3,4,5,6,7 --queries 640 --out RUNS
    python bench/solver_gap.py --runs RUNS/runs/grpo_flow_seed* --out docs/studies/solver_gap

The flow families whose checkpoints ship a multistep solver (SANA's DPM-Solver++, Wan's and Cosmos 3's UniPC) train and
evaluate with Euler steps on the solver's flow sigmas (models/families/flow_matching.py's ``flow_euler_scheduler``,
cosmos3.py's ``EulerOnTheSchedule``): the policy gradient needs a one-step policy, and a multistep solver's step reads
the previous steps' outputs. A user then samples the adapter with the pipeline as released. This measures what that
costs: each run's base model and its trained adapter (its ``lora/``) sample the same fresh prompts x seeds (drawn with
``--seed``, none of them the run's) from the same noise with the pipeline's Euler scheduler (the trained sampler) and
with each multistep solver (``--solvers``: DPM-Solver++ and UniPC of order 2 on flow sigmas of the checkpoint's
shift, as SANA's and Wan's released configs), at the run's evaluation steps; the run's reward scores every image.
Reported per solver (mean +- std over the runs): the base and adapter rewards, the adapter's gain, the gain's paired
difference to Euler's with its 95% t interval over the runs (paired by run: the same adapter and images' noise), and
how far the solver's images are from Euler's (mean |pixel difference|, base and adapter). Writes results.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compare_algorithms import difference_interval, mean_std  # noqa: E402
from config.base import base  # noqa: E402
from ddpo_group.offline.comparison import (find_run_config, prompt_seeds, resolve_finetuned, run_config,  # noqa: E402
                                           sample_images, score)
from ddpo_group.prompts import draw_prompts  # noqa: E402
from ddpo_group.rewards.combine import make_combined_reward  # noqa: E402


def solvers(euler, names: list[str]) -> dict:
    """{name: scheduler}: the pipeline's Euler scheduler and each multistep solver on flow sigmas of its shift."""
    from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler

    shift = float(euler.config.shift)
    common = dict(num_train_timesteps=euler.config.num_train_timesteps, prediction_type="flow_prediction",
                  use_flow_sigmas=True, flow_shift=shift, solver_order=2)
    made = {"euler": euler,
            "dpmsolver++": DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", final_sigmas_type="zero", **common),
            "unipc": UniPCMultistepScheduler(final_sigmas_type="zero", **common)}
    return {name: made[name] for name in ["euler", *names]}


def measure(run: Path, names: list[str], num_prompts: int, num_seeds: int, seed: int) -> dict:
    """One run's rewards and image distances under each sampler, base and adapter."""
    from ddpo_group.models import load_family

    saved, _ = find_run_config(run)
    config = run_config(base(), saved)
    family = load_family(config.pretrained.model, family=config.pretrained.family, config=config)
    pipe = family.pipe
    pipe.set_progress_bar_config(disable=True)
    prompts, metadata = draw_prompts(config.prompt_fn, config.prompt_fn_kwargs.to_dict(), num_prompts, seed)
    seeds = prompt_seeds(prompts, seed, num_seeds)
    reward = make_combined_reward(config.reward_fn, config.reward_fn_kwargs.to_dict())
    steps = config.sample.eval_num_steps or config.sample.num_steps
    settings = dict(num_steps=steps, guidance_scale=config.sample.guidance_scale, batch_size=16,
                    guidance_kwargs=family.guidance_kwargs, **family.pipeline_kwargs(config.sample, config.pretrained))
    rows_prompts = [p for p in prompts for _ in range(num_seeds)]
    rows_metadata = [m for m in metadata for _ in range(num_seeds)]
    samplers = solvers(pipe.scheduler, names)
    kind, source = resolve_finetuned(run)
    images, rewards = {}, {}
    for weights in ("base", "adapter"):
        if weights == "adapter":
            family.load_lora(pipe, source)
        for name, scheduler in samplers.items():
            pipe.scheduler = scheduler
            images[weights, name] = sample_images(pipe, prompts, seeds, **settings)
            rewards[weights, name] = score(reward, images[weights, name], rows_prompts, rows_metadata)["reward"]
    out = {"run": run.name, "kind": kind, "steps": steps, "n": len(rows_prompts)}
    for name in samplers:
        before, after = float(rewards["base", name].double().mean()), float(rewards["adapter", name].double().mean())
        out[name] = {"base": before, "adapter": after, "gain": after - before}
        if name != "euler":
            for weights in ("base", "adapter"):
                distance = (images[weights, name] - images[weights, "euler"]).abs().mean()
                out[name][f"pixels_{weights}"] = float(distance)
    return out


def table(rows: list[dict], names: list[str]) -> str:
    lines = ["| sampler | base reward | adapter reward | gain | gain - Euler's gain (95% interval, paired by run) | "
             "mean abs pixel difference to Euler's images (base / adapter) |", "|---|---|---|---|---|---|"]
    for name in ["euler", *names]:
        cells = [mean_std([r[name][k] for r in rows]) for k in ("base", "adapter", "gain")]
        if name == "euler":
            lines.append(f"| {name} (trained) | {' | '.join(cells)} | | |")
            continue
        pixels = " / ".join(mean_std([r[name][f"pixels_{w}"] for r in rows]) for w in ("base", "adapter"))
        if len(rows) > 1:
            mean, low, high = difference_interval([r[name]["gain"] for r in rows], [r["euler"]["gain"] for r in rows])
            difference = f"{mean:+.4f} ({low:+.4f} to {high:+.4f})"
        else:  # one run: no interval
            difference = f"{rows[0][name]['gain'] - rows[0]['euler']['gain']:+.4f}"
        lines.append(f"| {name} | {' | '.join(cells)} | {difference} | {pixels} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="run directories, each with its lora/")
    parser.add_argument("--solvers", default="dpmsolver++,unipc")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-seeds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1000, help="the fresh prompts' and noises' seed")
    parser.add_argument("--out", default="bench/results/solver_gap")
    args = parser.parse_args(argv)
    names = [name for name in args.solvers.split(",") if name]
    rows = [measure(Path(run), names, args.num_prompts, args.num_seeds, args.seed) for run in sorted(args.runs)]
    text = table(rows, names)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
