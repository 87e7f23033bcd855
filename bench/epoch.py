"""Wall time and peak memory of one full epoch of the default group_ppo run, phase by phase.

    python bench/epoch.py [--preset group_ppo] [--epochs 2] [--threads 1] [--set FIELD=VALUE ...] [--json PATH]

Runs the trainer (scripts/train.py's code path, wandb off, a temporary log directory) for ``--epochs``
epochs and reports the last one (the first pays one-off warm-up costs), which ends the run and so also
saves a checkpoint (the default run saves one every ``save_freq`` = 20 epochs; the table says so).
Phases (exclusive, from the trainer's PhaseTimer with GPU syncs at phase boundaries): sampling (text
encoding, denoising with log-probs, VAE decode), reward (waiting for the reward workers after sampling;
their compute runs in threads while sampling goes on and is shown apart), advantage (gather, estimator,
GROUP_PPO controller), training (policy update), reference/KL, critic (values while sampling and its
update), logging (metrics, reward curve, image grid, summary), checkpoint. Also the share of the epoch
inside the UNet's forward and backward, and peak memory: the process's peak RSS, and on CUDA the
maximum allocated during the epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from _common import UNetTimer, add_common_args, current_rss_mib, machine, peak_rss_mib, setup_threads

from config.base import get_config
from ddpo_group.rollout.reward_scorer import RewardScorer
from ddpo_group.timing import PHASES
from ddpo_group.run.trainer import Trainer

LABELS = {"reference": "reference/KL"}


def set_field(config, key: str, raw: str) -> None:
    from compare_algorithms import set_field as parse_set

    parse_set(config, key, raw)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="group_ppo")
    parser.add_argument("--epochs", type=int, default=2, help="epochs run; the last is reported")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    parser.add_argument("--json", default="", metavar="PATH", help="also write the measured figures to this JSON file")
    parser.add_argument("--memory-gb", type=float, default=0.0,
                        help="cap this process's CUDA memory (torch.cuda.set_per_process_memory_fraction): a smaller card")
    parser.add_argument("--leave-gb", type=float, default=0.0,
                        help="cap this process's CUDA memory at the card's less this much (others share the GPU)")
    add_common_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup_threads(args.threads)
    if args.memory_gb or args.leave_gb:
        total = torch.cuda.get_device_properties(0).total_memory
        allowed = args.memory_gb * 2**30 if args.memory_gb else total - args.leave_gb * 2**30
        torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, allowed / total)))
    config = get_config(args.preset)
    config.wandb.mode = "disabled"
    config.num_epochs = args.epochs
    for item in args.set:
        key, _, value = item.partition("=")
        set_field(config, key, value)
    with tempfile.TemporaryDirectory() as logdir:
        config.logdir, config.run_name = logdir, "bench_epoch"
        trainer = Trainer(config)
        trainer.timer.sync = True
        rss_setup = current_rss_mib()

        reward_compute = [0.0]
        reward_fn = trainer.rollouts.reward_fn

        def timed_reward(*a, **k):
            start = time.perf_counter()
            try:
                return reward_fn(*a, **k)
            finally:
                reward_compute[0] += time.perf_counter() - start

        # the sampling's reward calls only (the evaluation during training keeps its scorer)
        trainer.rollouts.sampler.score = RewardScorer(timed_reward, config.reward_fn)
        unet_timer = UNetTimer(trainer.family.model, trainer.accelerator.device)  # the denoiser, UNet or transformer
        trainer.accelerator.backward = unet_timer.wrap_backward(trainer.accelerator.backward)
        # cuda_graphs: the sampling steps' forwards go through the denoiser's compiled copy
        graphs_timer = None
        if trainer.sampling_model is not trainer.family.model:
            graphs_timer = UNetTimer(trainer.sampling_model, trainer.accelerator.device)

        def denoiser_total() -> float:
            return unet_timer.forward_s + unet_timer.backward_s + (graphs_timer.forward_s if graphs_timer else 0.0)

        marks = []
        train_epoch = trainer.train_epoch

        def marked_train_epoch(epoch):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            marks.append((trainer.timer.snapshot(), time.perf_counter(), denoiser_total(), reward_compute[0]))
            return train_epoch(epoch)

        trainer.train_epoch = marked_train_epoch
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
            last = trainer.run()  # its prints and progress bars stay quiet (an exception still propagates)
        end = time.perf_counter()
        phases = trainer.timer.since(marks[-1][0], trainer.timer.snapshot())
        wall = end - marks[-1][1]
        denoiser_s = denoiser_total() - marks[-1][2]
        cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None

    out = {"wall_s": wall, "phases": {p: phases.get(p, 0.0) for p in PHASES}, "denoiser_share": denoiser_s / wall,
           "peak_rss_mib": peak_rss_mib(), "rss_after_setup_mib": rss_setup, "cuda_max_allocated_mib": cuda_peak,
           "reward_compute_s": reward_compute[0] - marks[-1][3], "pairs_per_forward": last.get("train/pairs_per_forward"),
           "gradient_checkpointing": bool(trainer.family.model.is_gradient_checkpointing),
           "perf": {key: value for key, value in last.items() if key.startswith("perf/")},
           "preset": args.preset, "sets": args.set, "memory_cap_gb": args.memory_gb or None,
           "memory_left_gb": args.leave_gb or None,
           "machine": machine(args.device), "mixed_precision": config.mixed_precision,
           "samples": config.sample.batch_size * config.sample.num_batches_per_epoch, "steps": config.sample.num_steps}
    other = wall - sum(out["phases"].values())
    sample, train = config.sample, config.train
    print(f"machine: {machine(args.device)}; device {trainer.accelerator.device}, mixed precision {config.mixed_precision}")
    print(f"{args.preset} on {config.pretrained.model}: {sample.batch_size * sample.num_batches_per_epoch} samples x {sample.num_steps} steps, "
          f"CFG {sample.guidance_scale}, train.batch_size {train.batch_size}, step_fraction {train.step_fraction}, "
          f"beta {config.kl.beta}; epoch {args.epochs - 1} of {args.epochs} (the last: with a checkpoint)")
    cap = f" under a {args.memory_gb:g} GiB cap" if args.memory_gb else ""
    print(f"train.pairs_per_forward {train.pairs_per_forward} -> {out['pairs_per_forward']} pairs per forward{cap}, "
          f"gradient checkpointing {'on' if out['gradient_checkpointing'] else 'off'}")
    print("| phase | seconds | share |")
    print("|---|---:|---:|")
    for phase in PHASES:
        print(f"| {LABELS.get(phase, phase)} | {out['phases'][phase]:.3f} | {100 * out['phases'][phase] / wall:.1f}% |")
    print(f"| other (between phases) | {other:.3f} | {100 * other / wall:.1f}% |")
    print(f"| **epoch** | **{wall:.3f}** | 100% |")
    print(f"reward compute in worker threads (overlapped with sampling): {out['reward_compute_s']:.3f} s")
    print(f"denoiser forward+backward share of the epoch: {100 * out['denoiser_share']:.1f}%")
    print(f"memory: peak RSS {out['peak_rss_mib']:.0f} MiB (process), RSS after setup {rss_setup:.0f} MiB"
          + (f", CUDA max allocated in the epoch {cuda_peak:.0f} MiB" if cuda_peak is not None else ", CUDA: not used"))
    perf = out["perf"]
    print("throughput: " + ", ".join(f"{key[5:]} {value:.4g}" for key, value in sorted(perf.items())))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
