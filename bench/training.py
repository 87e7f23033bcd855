"""Training-phase throughput: our chunked (sample, step) update versus a ddpo-pytorch-style loop, side by side.

    python bench/training.py [--samples 32] [--steps 20] [--timestep-fraction 1.0] [--repeats 5] [--threads 1]

Both contenders train the same LoRA policy (the default config: LoRA rank 4, CFG 5, clip 1e-4, AdamW,
train.batch_size samples per optimizer step) on the same recorded trajectories and advantages, with the
same number of gradient contributions ((sample, step) pairs) and optimizer steps:

* ours: ``PolicyUpdater.train_epoch`` (ddpo_group/update/policy_update.py): every train batch's trained pairs
  flattened into the batch dimension, ``train.pairs_per_forward`` pairs per guided UNet forward;
* reference: the loop as ddpo-pytorch writes it (scripts/train.py there), written out below: for each
  train batch of samples, one timestep at a time (each sample its own permuted step), CFG as a doubled
  batch, backward per timestep, one optimizer step per train batch.

They run interleaved one train batch (one optimizer step) at a time: round r trains train batch
r mod (samples / batch size) with ours, then the same with the reference (the order alternating every
round), so that contention on a shared machine hits both alike. Prints pairs/s of each and the median
of the per-round speed-ups (target: ours >= 1.5x on the embedded model on the CPU). A further,
instrumented run of ours over the whole epoch measures the share of the training phase's wall time
spent inside the UNet's forward and backward (target >= 85%): forward from the UNet's forward hooks,
backward from the moment the loss gradient reaches the UNet's output to the end of the backward call.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from _common import UNetTimer, add_common_args, machine, median_ratio, setup_threads, side_by_side, sync

from config.base import get_config
from ddpo_group.models.trainable import build_policy, make_optimizer
from ddpo_group.update.policy_update import PolicyUpdater
from ddpo_group.prompts import PromptSampler
from ddpo_group.sampling.ddim import ddim_step_with_logprob
from ddpo_group.models.tiny_random import TINY_BUILDERS, save_pipeline
from ddpo_group.sampling.trajectories import TransitionScorer, sample_trajectories


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(TINY_BUILDERS), default="sd",
                        help="without --model: tiny-shapes (sd) or a tiny random SD3 / FLUX built from config; the "
                             "ddpo-pytorch loop exists for Stable Diffusion's UNet only")
    parser.add_argument("--model", default="")
    parser.add_argument("--num-frames", type=int, default=5, help="frames per video of a video family (wan)")
    parser.add_argument("--resolution", type=int, default=32, help="pixels, SDXL and the flow families")
    parser.add_argument("--prompt-fn", default="tiny_shapes")
    parser.add_argument("--samples", type=int, default=32, help="samples per epoch (default: 16 x 2 batches)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="train.batch_size")
    parser.add_argument("--pairs-per-forward", type=int, default=32)
    parser.add_argument("--timestep-fraction", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=12, help="interleaved rounds (one train batch each)")
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    parser.add_argument("--no-reference-loop", action="store_true", help="only ours (for the scaling tables)")
    add_common_args(parser)
    return parser.parse_args(argv)


def ddpo_pytorch_epoch(batch, unet, scheduler, optimizer, params, accelerator, negative, config, eta, timer=None):
    """The reference: ddpo-pytorch's training loop (one timestep of a train batch of samples at a time); ``eta``:
    DDIM's."""
    t = config.train
    num_samples, num_steps = batch["log_probs"].shape
    k = max(1, int(num_steps * t.timestep_fraction))
    scheduler.set_timesteps(config.sample.num_steps, device=accelerator.device)
    backward = timer.wrap_backward(accelerator.backward) if timer else accelerator.backward
    unet.train()
    for _ in range(t.num_inner_epochs):
        perm = torch.randperm(num_samples, device=accelerator.device)
        shuffled = {key: value[perm] for key, value in batch.items()}
        # each sample its own random order of timesteps; the first k are trained
        perms = torch.stack([torch.randperm(num_steps, device=accelerator.device) for _ in range(num_samples)])
        for key in ("latents", "next_latents", "log_probs", "timesteps", "advantages"):
            shuffled[key] = shuffled[key][torch.arange(num_samples, device=accelerator.device)[:, None], perms]
        info = {"approx_kl": [], "clipfrac": [], "loss": []}
        for start in range(0, num_samples, t.batch_size):
            sample = {key: value[start : start + t.batch_size] for key, value in shuffled.items()}
            embeds = torch.cat([negative.expand(len(sample["prompt_embeds"]), -1, -1), sample["prompt_embeds"]])
            for j in range(k):
                with accelerator.autocast():
                    noise_pred = unet(
                        torch.cat([sample["latents"][:, j]] * 2), torch.cat([sample["timesteps"][:, j]] * 2), embeds
                    ).sample
                    uncond, text = noise_pred.chunk(2)
                    noise_pred = uncond + config.sample.guidance_scale * (text - uncond)
                    step = ddim_step_with_logprob(scheduler, noise_pred, sample["timesteps"][:, j], sample["latents"][:, j],
                                                  eta, next_latents=sample["next_latents"][:, j])
                advantages = torch.clamp(sample["advantages"][:, j], -t.adv_clip_max, t.adv_clip_max)
                ratio = torch.exp(step.log_prob - sample["log_probs"][:, j])
                unclipped = -advantages * ratio
                clipped = -advantages * torch.clamp(ratio, 1.0 - t.clip_range, 1.0 + t.clip_range)
                loss = torch.mean(torch.maximum(unclipped, clipped))
                info["approx_kl"].append(0.5 * torch.mean((step.log_prob - sample["log_probs"][:, j]) ** 2))
                info["clipfrac"].append(torch.mean((torch.abs(ratio - 1.0) > t.clip_range).float()))
                info["loss"].append(loss)
                backward(loss / k)  # accumulated over the k timesteps (ddpo-pytorch's accumulation steps)
            accelerator.clip_grad_norm_(params, t.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        {key: torch.mean(torch.stack(value)).item() for key, value in info.items()}  # noqa: B018 (its logging)
    unet.eval()


def build(args, model: str):
    config = get_config("group_ppo")
    config.pretrained.model = model
    config.sample.resolution, config.pretrained.max_sequence_length = args.resolution, 16
    config.sample.num_frames = args.num_frames
    if args.family == "flux":  # FLUX.1-dev's guidance is an embedding: no unconditional forward
        config.sample.guidance_scale, config.train.cfg = 3.5, False
    config.mixed_precision = args.mixed_precision
    config.sample.num_steps = args.steps
    config.train.batch_size = args.batch_size
    config.train.pairs_per_forward = args.pairs_per_forward
    config.train.timestep_fraction = args.timestep_fraction
    accelerator = Accelerator(cpu=args.device == "cpu", mixed_precision=args.mixed_precision)
    family, params = build_policy(config, accelerator.device)
    pipe = family.pipe
    optimizer = make_optimizer(config, params)
    unet, optimizer = accelerator.prepare(family.model, optimizer)
    negative = family.negative_condition()["prompt_embeds"]
    prompts, _ = PromptSampler(args.prompt_fn, seed=0).sample(args.samples)
    cond = family.encode(prompts)
    with torch.no_grad(), accelerator.autocast():
        traj = sample_trajectories(family, family.model, cond, family.negative_condition(), args.steps,
                                   config.sample.guidance_scale, family.noise_levels(config.sample),
                                   generator=torch.Generator(accelerator.device).manual_seed(0), decode=False)
    batch = {
        **cond, "latents": traj.latents[:, :-1], "next_latents": traj.latents[:, 1:], "log_probs": traj.log_probs,
        **traj.steps,
        "advantages": torch.randn(args.samples, 1, generator=torch.Generator().manual_seed(0))
        .expand(-1, args.steps).contiguous().to(accelerator.device),
    }
    updater = PolicyUpdater(config, accelerator, unet, optimizer, params,
                            TransitionScorer.from_config(config, family))
    return config, accelerator, pipe, unet, optimizer, params, negative, batch, updater


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or ("tiny-shapes" if args.family == "sd" else
                               save_pipeline(TINY_BUILDERS[args.family](), Path(scratch) / args.family))
        return run(args, model)


def run(args, model: str) -> dict:
    config, accelerator, pipe, unet, optimizer, params, negative, batch, updater = build(args, model)
    k = max(1, int(args.steps * args.timestep_fraction))
    pairs = args.samples * k * config.train.num_inner_epochs
    round_pairs = args.batch_size * k * config.train.num_inner_epochs
    train_batches = [{key: value[i : i + args.batch_size] for key, value in batch.items()}
                     for i in range(0, args.samples, args.batch_size)]
    counter = {"ours": 0, "reference": 0}

    def next_batch(name):
        counter[name] += 1
        return train_batches[(counter[name] - 1) % len(train_batches)]

    contenders = {"ours": lambda: updater.train_epoch(next_batch("ours"), show_progress=False)}
    if not args.no_reference_loop and updater.scorer.family.name == "sd":  # the reference loop calls a UNet
        contenders["ddpo-pytorch loop"] = lambda: ddpo_pytorch_epoch(
            next_batch("reference"), unet, pipe.scheduler, optimizer, params, accelerator, negative, config,
            updater.scorer.family.noise_level(config.sample))
    times = side_by_side(contenders, args.repeats, args.device)

    # the instrumented run: share of the training phase inside the UNet's forward and backward
    timer = UNetTimer(accelerator.unwrap_model(unet), args.device)
    plain_backward = accelerator.backward
    accelerator.backward = timer.wrap_backward(plain_backward)
    sync(args.device)
    start = time.perf_counter()
    updater.train_epoch(batch, show_progress=False)
    sync(args.device)
    wall = time.perf_counter() - start
    accelerator.backward = plain_backward
    timer.remove()
    share = (timer.forward_s + timer.backward_s) / wall

    print(f"machine: {machine(args.device)}; device {args.device}, mixed precision {args.mixed_precision}")
    print(f"{updater.scorer.family.name} ({model}): {args.samples} samples x {k} of {args.steps} steps = {pairs} trained (sample, step) pairs per "
          f"epoch, train.batch_size {args.batch_size} ({args.samples // args.batch_size} optimizer steps), "
          f"pairs_per_forward {args.pairs_per_forward}, CFG {config.sample.guidance_scale}; {args.repeats} interleaved rounds "
          f"of one train batch ({round_pairs} pairs)")
    out = {"pairs": pairs, "unet_share": share}
    t_ours = statistics.median(times["ours"])
    out["ours_pairs_per_s"] = round_pairs / t_ours
    print(f"  ours (chunked pairs)         : median {t_ours:7.3f} s per train batch  {round_pairs / t_ours:8.1f} pairs/s")
    if "ddpo-pytorch loop" in times:
        t_ref = statistics.median(times["ddpo-pytorch loop"])
        speedup = median_ratio(times["ddpo-pytorch loop"], times["ours"])
        out.update(reference_pairs_per_s=round_pairs / t_ref, speedup=speedup)
        print(f"  ddpo-pytorch loop (per step) : median {t_ref:7.3f} s per train batch  {round_pairs / t_ref:8.1f} pairs/s")
        print(f"  speed-up ours / ddpo-pytorch (median of per-round ratios): {speedup:.2f}x  "
              f"(target >= 1.5x: {'met' if speedup >= 1.5 else 'NOT met'}); per-round "
              + ", ".join(f"{b / a:.2f}" for a, b in zip(times["ours"], times["ddpo-pytorch loop"])))
    print(f"  denoiser share of our training phase: {100 * share:.1f}% (forward {timer.forward_s:.3f} s in "
          f"{timer.forwards} calls, backward {timer.backward_s:.3f} s, of {wall:.3f} s; target >= 85%: "
          f"{'met' if share >= 0.85 else 'NOT met'})")
    return out


if __name__ == "__main__":
    main()
