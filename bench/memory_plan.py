"""The memory plan: every family's training step at full size traced on the CPU with fake tensors
(ddpo_group/update/memory_trace.py), LoRA and full fine-tuning, at its recipe's settings; what fits one card.

    python bench/memory_plan.py [--family sd3 flux ...] [--mode lora full] [--json PATH]
    python bench/memory_plan.py --validate [--family sd3]   # the runs measured on a GPU, traced: peaks side by side
    python bench/memory_plan.py --table ROWS.jsonl [...]   # the table of rows written before
    python bench/memory_plan.py --tiny --family sd      # the tiny pipelines instead (seconds: a check that it runs)
    python bench/memory_plan.py --checkpointing --family sana_video   # with gradient checkpointing on

For each family and mode: the run its recipe describes (``PLAN``: the recipe, or the family's preset at the
pipeline's defaults where no anchor published one) on models/full_size.py's shape, ``use_lora`` set by the mode;
trace(1) and trace(2), the peaks of the step with one and two (sample, step) pairs per forward, give

    per_pair = trace(2) - trace(1),   held = trace(1) - per_pair   (weights, the record, Adam's state, ...)
    pairs(card) = floor((HEADROOM x card - held) / per_pair)       (update/memory_fit.py's HEADROOM; at most a train batch's pairs)

trace(k) is the forward + backward's peak; the optimizer step's (AdamW's temporaries beside the gradients) is traced
apart and must fit too (0 pairs where it does not).

for an 80 GB card (79.1 GiB usable, as an H100 reports) and a 24 GiB cap; 0 pairs: it does not fit. The size is then
traced, and per_pair and held fitted again from trace(1) and trace(size) (update/memory_fit.py's step 5: a full
fine-tuning's peak at one pair comes where the gradients are nearly whole and the activations nearly freed), until
the size holds; per_pair and held are the 80 GB card's. One JSON line a (family, mode) goes to stdout and ``--json``;
a table follows. Each trace takes seconds (SD-1.5) to minutes (the
largest transformers) of one CPU core and a few GiB of memory (LoRA's adapters are real tensors).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config.base import get_config  # noqa: E402
from ddpo_group.models.full_size import BUILDERS  # noqa: E402
from ddpo_group.models.tiny_random import TINY_BUILDERS  # noqa: E402
from ddpo_group.models.trainable import DTYPES  # noqa: E402
from ddpo_group.update.memory_fit import HEADROOM, most_pairs, plan_key  # noqa: E402
from ddpo_group.update.memory_trace import (GIB, fake_mode, fake_pipeline, trace_step, traced_precision,  # noqa: E402
                                            traced_run)

CARDS = {"80GB": 79.1 * GIB, "24GiB": 24.0 * GIB}  # an H100 80GB's total as torch.cuda reports it; the cap

# family: (models/full_size.py shape, the recipe or preset, overrides, what the row stands for)
PLAN = {
    "sd": ("sd15", "group_ppo", {"sample.num_steps": 20, "sample.batch_size": 16, "sample.num_batches_per_epoch": 2,
                                 "sample.sde_window_size": 0, "mixed_precision": "bf16"},
           "the H100 run of docs/performance.md: every step trained"),
    "sdxl": ("sdxl", "grpo", {"mixed_precision": "bf16"}, "the grpo preset, 1024 px"),
    "sd3": ("sd35m", "flow_grpo_sd35", {}, ""),
    "flux": ("flux", "flow_grpo_flux", {}, ""),
    "flux_kontext": ("flux_kontext", "flow_factory_flux_kontext", {}, ""),
    "flux2": ("flux2_klein4b", "flow_factory_flux2_klein", {}, "the 4B shape (the recipe's model is the 9B)"),
    "zimage": ("zimage", "flow_factory_zimage", {}, ""),
    "qwenimage": ("qwenimage", "flow_grpo_qwenimage", {}, ""),
    "qwenimage_edit": ("qwenimage_edit_plus", "flow_grpo_qwenimage_edit_plus", {}, ""),
    "wan": ("wan13b", "flow_factory_wan21", {}, "the 1.3B shape (the recipe's model is the 14B)"),
    "wan_i2v": ("wan21_i2v14b", "flow_factory_wan21_i2v", {}, ""),
    "sana": ("sana", "cosmos_rl_sana_nft", {}, ""),
    "qwenimage21": ("qwenimage21", "flow_grpo_qwenimage21", {}, ""),
    "hunyuan_video15": ("hunyuan_video15", "unirl_hunyuan_video15", {}, ""),
    "ltx2": ("ltx2", "flow_factory_ltx2", {}, ""),
    "krea2": ("krea2", "miles_krea2_nft", {}, ""),
    "sana_video": ("sana_video", "cosmos_rl_sana_video_nft", {}, ""),
    "cosmos3": ("cosmos3", "miles_cosmos3_pickscore", {}, "the class defaults' 15B (the recipe names Cosmos3-Nano)"),
    "kandinsky6": ("kandinsky6", "grpo", {"mixed_precision": "bf16", "train.gradient_checkpointing": True},
                   "no published recipe: the grpo preset at the pipeline's defaults"),
    "hunyuan_image": ("hunyuan_image", "grpo", {"mixed_precision": "bf16", "train.gradient_checkpointing": True},
                      "no published recipe: the grpo preset at the pipeline's defaults"),
    "ideogram4": ("ideogram4", "grpo", {"mixed_precision": "bf16", "train.gradient_checkpointing": True},
                  "no published recipe: the grpo preset at the pipeline's defaults"),
}


# the runs measured on a GPU (docs/studies/performance): (family, shape, preset or recipe, overrides, pairs per
# forward the auto-fit chose, CUDA max allocated in GiB, where)
GPU_CHECK = {"prompt_fn": "simple_animals", "sample.sde_window_size": 0, "sample.num_batches_per_epoch": 1,
             "sample.batch_size": 8, "train.batch_size": 8, "train.group_size": 8, "mixed_precision": "bf16"}
MEASURED = [
    ("sd", "sd15", "group_ppo", PLAN["sd"][2], 30, 67.2, "H100, 80 GB: group_ppo, 32 images x 20 steps"),
    ("sd", "sd15", "group_ppo", PLAN["sd"][2], 8, 19.5, "H100, 24 GiB cap: the same"),
    ("sd", "sd15", "grpo", {**GPU_CHECK, "sample.num_steps": 20}, 28, 65.2, "H100, 80 GB: the GPU check's SD-1.5"),
    ("sd", "sd15", "grpo", {**GPU_CHECK, "sample.num_steps": 20}, 8, 20.1, "H100 and H200, 24 GiB cap: the same"),
    ("sd3", "sd35m", "flow_grpo_sd35", GPU_CHECK, 13, 65.8, "H100, 80 GB: the GPU check's SD3.5-M"),
    ("sd3", "sd35m", "flow_grpo_sd35", GPU_CHECK, 22, 106.7, "H200, the card less 16 GiB: the same, compiled"),
    ("sd3", "sd35m", "flow_grpo_sd35", {**GPU_CHECK, "train.gradient_checkpointing": True}, 38, 21.2,
     "H200, 24 GiB cap: the same with gradient checkpointing"),
    ("sd3", "sd35m", "flow_grpo_sd35", {**GPU_CHECK, "train.gradient_checkpointing": True, "use_lora": False}, 79,
     78.4, "H200: full fine-tuning, gradient checkpointing"),
]


def set_fields(config, overrides: dict) -> None:
    """Set ``overrides`` ({"train.batch_size": 8, ...}) on ``config``."""
    for key, value in overrides.items():
        *path, leaf = key.split(".")
        target = config
        for part in path:
            target = target[part]
        target[leaf] = value


def plan_config(family: str, use_lora: bool, checkpointing: bool = False):
    """The config of ``family``'s row (``PLAN``), LoRA or full fine-tuning, with gradient checkpointing if asked."""
    shape, name, overrides, _ = PLAN[family]
    config = get_config(name)
    config.pretrained.family = family
    set_fields(config, overrides)
    config.use_lora = use_lora
    if checkpointing:  # what the auto-fit switches on when fewer than 4 pairs fit without it
        config.train.gradient_checkpointing = True
    config.train.pairs_per_forward = 1
    return config


def fits(held: float, per_pair: float, card: float, most: int) -> int:
    """The pairs per forward that fit ``card`` bytes (module docstring), at most ``most``; 0: none."""
    return max(0, min(most, int((HEADROOM * card - held) // per_pair)))


def plan_row(family: str, mode: str, tiny: bool = False, checkpointing: bool = False) -> dict:
    """One row of the plan: ``family``'s step in ``mode`` ("lora" or "full") traced (module docstring)."""
    shape, name, _, stands_for = PLAN[family]
    config = plan_config(family, mode == "lora", checkpointing)
    started = time.time()
    fake = fake_mode()
    build = TINY_BUILDERS[family] if tiny else BUILDERS[shape]
    run = traced_run(config, fake_pipeline(build, fake, DTYPES[traced_precision(config)]), fake)
    def trace(k):
        return trace_step(run, k)

    most = most_pairs(config.train, run.trainable)
    one, two = trace(1), trace(2)
    optimizer = max(one.optimizer_peak, two.optimizer_peak)
    cards = {}
    for card, size in CARDS.items():  # fitted from 1 and 2 pairs, then traced at the size and fitted again from it
        per_pair = max(two.peak - one.peak, 1)
        held = one.peak - per_pair
        n, at = fits(held, per_pair, size, most), two
        for _ in range(3):
            if n <= 2 or n == at.pairs:
                break
            at = trace(n)
            per_pair = max((at.peak - one.peak) // (n - 1), 1)
            held = one.peak - per_pair
            n = fits(held, per_pair, size, most)
        cards[card] = (n if optimizer <= HEADROOM * size else 0, at, per_pair, held)
    _, at, per_pair, held = cards["80GB"]
    return {"family": family, "mode": mode, "shape": f"tiny {family}" if tiny else shape, "recipe": name,
            "stands_for": stands_for,
            **plan_key(run.family, config, run.updater),
            "state": list(run.batch.latents.shape[2:]), "rows": len(run.batch), "steps": run.batch.num_steps,
            "trainable": one.trainable, "trace_1_gib": round(one.gib(), 3), "trace_2_gib": round(two.gib(), 3),
            "kinds_1_gib": {kind: round(value / GIB, 3) for kind, value in one.kinds.items()},
            "per_pair_gib": round(per_pair / GIB, 3), "held_gib": round(held / GIB, 3),
            "optimizer_step_gib": round(optimizer / GIB, 3),
            **{f"pairs_{card}": n for card, (n, _, _, _) in cards.items()},
            **{f"traced_{card}": [at.pairs, round(at.gib(), 3)] for card, (_, at, _, _) in cards.items()},
            "notes": run.notes, "seconds": round(time.time() - started, 1)}


def validate(families) -> None:
    """Each run of ``families`` measured on a GPU (``MEASURED``) traced at the pairs its auto-fit chose: the step's
    traced peak (the forward + backward's, or the optimizer step's when higher) against the CUDA max allocated it
    measured."""
    print("| run | pairs | traced peak | measured | traced / measured |\n|---|---:|---:|---:|---:|", flush=True)
    runs = {}
    for family, shape, name, overrides, pairs, measured, where in MEASURED:
        if family not in families:
            continue
        key = (shape, name, json.dumps(overrides, sort_keys=True))
        if key not in runs:
            config = get_config(name)
            config.pretrained.family = family
            set_fields(config, overrides)
            fake = fake_mode()
            runs[key] = traced_run(config, fake_pipeline(BUILDERS[shape], fake, DTYPES[traced_precision(config)]),
                                   fake)
        step = trace_step(runs[key], pairs)
        traced = max(step.peak, step.optimizer_peak) / GIB
        print(f"| {where} | {pairs} | {traced:.1f} GiB | {measured:.1f} GiB | {traced / measured:.3f} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", default=list(PLAN), choices=list(PLAN))
    parser.add_argument("--mode", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--json", default="", metavar="PATH", help="append each row to this file, one JSON line")
    parser.add_argument("--checkpointing", action="store_true",
                        help="with gradient checkpointing (train.gradient_checkpointing=True) whatever the recipe says")
    parser.add_argument("--tiny", action="store_true",
                        help="trace the families' tiny random pipelines instead (a check that the plan runs)")
    parser.add_argument("--table", nargs="+", default=[], metavar="PATH",
                        help="print the plan's table from these files of rows (--json's) instead")
    parser.add_argument("--validate", action="store_true",
                        help="trace the runs measured on a GPU instead (MEASURED) and compare their peaks")
    args = parser.parse_args(argv)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.processor_without_video import allow_a_processor_without_video

    allow_a_processor_without_video()  # the Qwen-VL processors without torchvision (the pipelines send no video)
    if args.validate:
        validate(args.family)
        return
    if args.table:
        rows = [json.loads(line) for path in args.table for line in open(path) if line.strip()]
        print(table(rows))
        return
    rows = []
    for family in args.family:
        for mode in args.mode:
            try:
                row = plan_row(family, mode, args.tiny, args.checkpointing)
            except Exception as error:  # noqa: BLE001  (one family's failure is reported, the others traced)
                row = {"family": family, "mode": mode, "shape": PLAN[family][0], "recipe": PLAN[family][1],
                       "error": f"{type(error).__name__}: {error}"[:500]}
                traceback.print_exc(file=sys.stderr)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps(row) + "\n")
    print()
    print(table(rows))


def table(rows: list[dict]) -> str:
    """The plan as a markdown table, a family's LoRA and full fine-tuning rows side by side (the last row of each)."""
    lines = ["| family (shape, recipe) | trainable | LoRA: per pair / held | pairs 80 GB / 24 GiB | "
             "full: per pair / held / optimizer step | pairs 80 GB / 24 GiB |", "|---|---|---|---|---|---|"]
    for family in dict.fromkeys(row["family"] for row in rows):
        cells = {row["mode"]: row for row in rows if row["family"] == family}
        first = next(iter(cells.values()))
        name = f"{family} ({first['shape']}, {first['recipe']}"
        name += f"; {PLAN[family][3]})" if PLAN[family][3] else ")"
        out = [name]
        trainable = [f"{cells[m]['trainable'] / 1e6:,.0f}M" for m in ("lora", "full") if m in cells and "error" not in cells[m]]
        out.append(" / ".join(trainable))
        for mode in ("lora", "full"):
            row = cells.get(mode)
            if row is None:
                out += ["", ""]
            elif "error" in row:
                out += [f"not traced: {row['error'][:120]}", ""]
            else:
                gc = " (GC)" if row["gradient_checkpointing"] else ""
                if mode == "full" and row["pairs_80GB"] == 0:  # its per pair read where gradients set the peak
                    held = f"held {row['held_gib']:.1f}{gc}"
                else:
                    held = f"{row['per_pair_gib']:.2f} / {row['held_gib']:.1f}{gc}"
                if mode == "full":
                    held += f" / {row['optimizer_step_gib']:.1f}"
                out += [held + " GiB", f"{row['pairs_80GB']} / {row['pairs_24GiB']}"]
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
