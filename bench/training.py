"""Training-phase throughput: our chunked (sample, step) update versus the loop users run today, side by side.

    python bench/training.py [--samples 32] [--steps 20] [--step-fraction 1.0] [--repeats 5] [--threads 1]
    python bench/training.py --family sd3 [--resolution 32]    # a tiny random SD3 (or flux) built from config
    python bench/training.py --model DIR --device cuda --mixed-precision bf16 --resolution 512 --json out.json

Both contenders train the same LoRA policy (the default config: LoRA rank 4, clip 1e-4, AdamW, train.batch_size
samples per optimizer step) on the same recorded trajectories and advantages, with the same number of gradient
contributions ((sample, step) pairs) and optimizer steps; every step is stochastic and trained unless
``--sde-window-size`` says otherwise (as in both reference loops):

* ours: the trainer's update loop, ``Updater.train_epoch`` (ddpo_group/update/updater.py), with PolicyUpdater's chunk
  loss (ddpo_group/update/policy_update.py): every train batch's trained pairs flattened into the batch dimension,
  ``train.pairs_per_forward`` pairs per guided forward;
* the reference, chosen from the family: Stable Diffusion's UNet (sd) -> the loop as ddpo-pytorch writes it
  (scripts/train.py there); a flow-matching family (sd3, flux, ...) -> the loop as Flow-GRPO writes it
  (scripts/train_sd3.py there). Both are written out below: for each train batch of samples, one timestep at a time
  (ddpo-pytorch: each sample its own permuted step; Flow-GRPO: the first int(W x step_fraction) of the W
  stochastic steps, in order), CFG as a doubled batch (negative and positive embeddings concatenated: one forward of
  2B rows), the step's log-prob of the recorded next latent by the same step function as ours (DDIM's; the flow
  step of ``sample.sde_type``), the PPO clipped loss, backward per timestep (gradients accumulated over the
  timesteps), one optimizer step per train batch. Other families (SDXL) time ours only.

Before any update, both compute the loss and the LoRA gradient of the same pairs of one train batch: the printed
max |difference| shows the reference computes what ours does (only the batching differs).
They run interleaved one train batch (one optimizer step) at a time: round r trains train batch
r mod (samples / batch size) with ours, then the same with the reference (the order alternating every
round), so that contention on a shared machine hits both alike. Prints pairs/s of each and the median
of the per-round speed-ups (target: ours >= 1.5x on the embedded model on the CPU, >= 2x on a GPU). A further,
instrumented run of ours over the whole epoch measures the share of the training phase's wall time
spent inside the denoiser's forward and backward (target >= 85%): forward from its forward hooks,
backward from the moment the loss gradient reaches its output to the end of the backward call.
``--json PATH`` writes the figures. ``--compile-denoiser regional`` (or full) compiles the denoiser for ours, as the
trainer does (compile_denoiser); the reference loop then runs the same modules uncompiled, as users run it today.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from _common import (UNetTimer, add_common_args, bench_config, bench_model, machine, median_ratio, setup_threads,
                     side_by_side, sync, train_batches)

from ddpo_group.models.families.flow_matching import FlowMatchingFamily
from ddpo_group.models.speed_options import compile_denoiser, eager
from ddpo_group.models.trainable import build_policy, make_optimizer
from ddpo_group.update.memory_fit import PairsPerForward
from ddpo_group.update.policy_update import PolicyUpdater
from ddpo_group.update.updater import UpdateOptions
from ddpo_group.prompts import PromptSampler
from ddpo_group.sampling.ddim import ddim_step_with_logprob
from ddpo_group.sampling.flow_steps import flow_step_with_logprob
from ddpo_group.models.tiny_random import TINY_BUILDERS
from ddpo_group.sampling.trajectories import SamplingOptions, TransitionScorer, sample_trajectories


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(TINY_BUILDERS), default="sd",
                        help="without --model: tiny-shapes (sd) or a tiny random SD3 / FLUX built from config; the "
                             "reference loop: ddpo-pytorch's for sd, Flow-GRPO's for the flow-matching families")
    parser.add_argument("--model", default="", help="a saved diffusers pipeline (e.g. bench/random_model.py --shape "
                        "sd35m --out DIR); its family is detected")
    parser.add_argument("--num-frames", type=int, default=5, help="frames per video of a video family (wan)")
    parser.add_argument("--resolution", type=int, default=32, help="pixels, SDXL and the flow families")
    parser.add_argument("--max-sequence-length", type=int, default=16, help="T5 tokens, flow families")
    parser.add_argument("--prompt-fn", default="tiny_shapes")
    parser.add_argument("--samples", type=int, default=32, help="samples per epoch (default: 16 x 2 batches)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="train.batch_size")
    parser.add_argument("--pairs-per-forward", default="32", help="train.pairs_per_forward: a number, or auto (the "
                        "trainer's: on CUDA the most that fit the card, measured before the first update)")
    parser.add_argument("--step-fraction", type=float, default=1.0)
    parser.add_argument("--sde-window-size", type=int, default=0, help="sample.sde_window_size: the first N steps "
                        "stochastic and trained (0: every step, as the reference loops train; ddpo-pytorch's takes 0 only)")
    parser.add_argument("--guidance", type=float, default=None, help="sample.guidance_scale (default: config/base.py's; "
                        "FLUX: 3.5, its guidance embedding, no CFG)")
    parser.add_argument("--lora-rank", type=int, default=None, help="lora_rank (default: config/base.py's)")
    parser.add_argument("--compile-denoiser", choices=["no", "regional", "full"], default="no",
                        help="compile the denoiser for ours (the reference loop stays eager)")
    parser.add_argument("--repeats", type=int, default=12, help="interleaved rounds (one train batch each)")
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    parser.add_argument("--no-reference-loop", action="store_true", help="only ours (for the scaling tables)")
    parser.add_argument("--json", default="", help="write the measured figures to this JSON file")
    add_common_args(parser)
    return parser.parse_args(argv)


def clipped_loss(log_prob, sample: dict, j: int, t, info: dict) -> torch.Tensor:
    """The PPO clipped loss of timestep ``j`` of the train batch ``sample`` as both reference loops write it (the
    advantages clipped to adv_clip_max, the ratio to the recorded log-prob), with its approx KL and clip fraction."""
    advantages = torch.clamp(sample["advantages"][:, j], -t.adv_clip_max, t.adv_clip_max)
    ratio = torch.exp(log_prob - sample["log_probs"][:, j])
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - t.clip_range, 1.0 + t.clip_range)
    loss = torch.mean(torch.maximum(unclipped, clipped))
    info["approx_kl"].append(0.5 * torch.mean((log_prob - sample["log_probs"][:, j]) ** 2))
    info["clipfrac"].append(torch.mean((torch.abs(ratio - 1.0) > t.clip_range).float()))
    info["loss"].append(loss)
    return loss


def end_of_train_batch(info: dict, k: int, accelerator, params, optimizer, t, update: bool) -> torch.Tensor:
    """The end of a reference loop's train batch: one clipped optimizer step (``update``); returns its loss, the mean
    over its k timesteps."""
    if update:
        accelerator.clip_grad_norm_(params, t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(info["loss"][-k:]).mean().detach()


def ddpo_pytorch_epoch(batch, unet, scheduler, optimizer, params, accelerator, negative, config, eta, update=True):
    """The reference on Stable Diffusion: ddpo-pytorch's training loop (one timestep of a train batch of samples at a
    time); ``eta``: DDIM's. Returns the mean over train batches of their loss (the mean over the trained timesteps);
    ``update=False`` only accumulates the gradients (no clipping, no optimizer step)."""
    train = config.train
    num_samples, num_steps = batch["log_probs"].shape
    k = max(1, int(num_steps * train.step_fraction))
    scheduler.set_timesteps(config.sample.num_steps, device=accelerator.device)
    backward, losses = accelerator.backward, []
    unet.train()
    for _ in range(train.num_inner_epochs):
        perm = torch.randperm(num_samples, device=accelerator.device)
        shuffled = {key: value[perm] for key, value in batch.items()}
        # each sample its own random order of timesteps; the first k are trained
        perms = torch.stack([torch.randperm(num_steps, device=accelerator.device) for _ in range(num_samples)])
        for key in ("latents", "next_latents", "log_probs", "timesteps", "advantages"):
            shuffled[key] = shuffled[key][torch.arange(num_samples, device=accelerator.device)[:, None], perms]
        info = {"approx_kl": [], "clipfrac": [], "loss": []}
        for start in range(0, num_samples, train.batch_size):
            sample = {key: value[start : start + train.batch_size] for key, value in shuffled.items()}
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
                loss = clipped_loss(step.log_prob, sample, j, train, info)
                backward(loss / k)  # accumulated over the k timesteps (ddpo-pytorch's accumulation steps)
            losses.append(end_of_train_batch(info, k, accelerator, params, optimizer, train, update))
        {key: torch.mean(torch.stack(value)).item() for key, value in info.items()}  # noqa: B018 (its logging)
    unet.eval()
    return torch.stack(losses).mean()


def flow_grpo_epoch(batch, transformer, family, optimizer, params, accelerator, config, trained_steps, update=True):
    """The reference on the flow-matching families: Flow-GRPO's training loop (scripts/train_sd3.py there; its
    train_flux.py alike without CFG). For each train batch of samples, the trained timesteps ``trained_steps`` one at a
    time, in order; SD3's classifier-free guidance as one forward of the doubled batch (the negative embeddings
    concatenated before the prompts'), another family's forward as the family computes it; the log-prob of the
    recorded next latent under the flow SDE step (sample.sde_type at the family's noise level); the PPO clipped loss;
    backward per timestep (accumulated over the timesteps), one optimizer step per train batch. Returns the mean over
    train batches of their loss; ``update=False`` only accumulates the gradients (no clipping, no optimizer step)."""
    train, sampling = config.train, config.sample
    num_samples, k = batch["log_probs"].shape[0], len(trained_steps)
    device = accelerator.device
    guidance = family.training_guidance(config)
    guided = guidance > family.no_guidance
    negative, noise_level = family.negative_condition(), family.noise_level(sampling)
    losses = []
    transformer.train()
    for _ in range(train.num_inner_epochs):
        perm = torch.randperm(num_samples, device=device)
        shuffled = {key: value[perm] for key, value in batch.items()}
        info = {"approx_kl": [], "clipfrac": [], "loss": []}
        for start in range(0, num_samples, train.batch_size):
            sample = {key: value[start : start + train.batch_size] for key, value in shuffled.items()}
            n = len(sample["latents"])
            if family.name == "sd3" and guided:  # negative prompts concatenated to the prompts: one forward
                embeds = torch.cat([negative["prompt_embeds"].expand(n, -1, -1), sample["prompt_embeds"]])
                pooled = torch.cat([negative["pooled_prompt_embeds"].expand(n, -1), sample["pooled_prompt_embeds"]])
            for j in trained_steps:
                latents, timesteps = sample["latents"][:, j], sample["timesteps"][:, j]
                with accelerator.autocast():
                    if family.name == "sd3" and guided:
                        out = transformer(hidden_states=torch.cat([latents] * 2), timestep=torch.cat([timesteps] * 2),
                                          encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False)[0]
                        uncond, text = out.chunk(2)
                        velocity = uncond + sampling.guidance_scale * (text - uncond)
                    else:
                        cond = {key: sample[key] for key in family.cond_keys}
                        step_j = {key: sample[key][:, j] for key in family.time_keys}
                        velocity = family.model_output(transformer, latents, step_j, cond, negative, guidance)
                    step = flow_step_with_logprob(sampling.sde_type, velocity, latents, sample["sigmas"][:, j],
                                                  sample["next_sigmas"][:, j], noise_level,
                                                  next_latents=sample["next_latents"][:, j], reduce=sampling.log_prob_reduce)
                loss = clipped_loss(step.log_prob, sample, j, train, info)
                accelerator.backward(loss / k)  # accumulated over the k timesteps (Flow-GRPO's accumulation steps)
            losses.append(end_of_train_batch(info, k, accelerator, params, optimizer, train, update))
        {key: torch.mean(torch.stack(value)).item() for key, value in info.items()}  # noqa: B018 (its logging)
    transformer.eval()
    return torch.stack(losses).mean()


def reference_loop(family) -> str | None:
    """The loop users run today on this family: ddpo-pytorch's on Stable Diffusion's UNet, Flow-GRPO's on a
    flow-matching transformer; None for the others (SDXL: neither loop handles its added conditions)."""
    if family.name == "sd":
        return "ddpo-pytorch loop"
    if isinstance(family, FlowMatchingFamily):
        return "Flow-GRPO loop"
    return None


def build(args, model: str):
    config = bench_config(args, model)
    if args.lora_rank is not None:
        config.lora_rank = args.lora_rank
    config.sample.sde_window_start, config.sample.sde_window_size = 0, args.sde_window_size
    config.train.pairs_per_forward = args.pairs_per_forward if args.pairs_per_forward == "auto" \
        else int(args.pairs_per_forward)
    config.train.step_fraction = args.step_fraction
    accelerator = Accelerator(cpu=args.device == "cpu", mixed_precision=args.mixed_precision)
    family, params = build_policy(config, accelerator.device)
    if family.guidance_embedded:  # a --model FLUX: guidance in the forward, no CFG
        config.train.cfg = False
    else:
        config.train.cfg = config.sample.guidance_scale > family.no_guidance
    pipe = family.pipe
    optimizer = make_optimizer(config, params)
    if args.compile_denoiser != "no":  # as the trainer: after the policy is built, before accelerate wraps it
        compile_denoiser(family.model, args.compile_denoiser, accelerator.device)
    unet, optimizer = accelerator.prepare(family.model, optimizer)
    negative = family.negative_condition()["prompt_embeds"]
    prompts, _ = PromptSampler(args.prompt_fn, seed=0).sample(args.samples)
    cond = family.encode(prompts)
    with torch.no_grad(), accelerator.autocast():
        traj = sample_trajectories(family, family.model, cond, family.negative_condition(),
                                   SamplingOptions(args.steps, config.sample.guidance_scale,
                                                   family.noise_levels(config.sample), decode=False),
                                   generator=torch.Generator(accelerator.device).manual_seed(0))
    advantages = torch.randn(args.samples, 1, generator=torch.Generator().manual_seed(0))
    batches = train_batches(cond, traj, advantages.expand(-1, args.steps).contiguous().to(accelerator.device),
                            args.batch_size)
    updater = PolicyUpdater(UpdateOptions(config, accelerator, unet, optimizer, params,
                                          TransitionScorer.from_config(config, family),
                                          pairs_per_forward=PairsPerForward(config, accelerator, family, {})))  # as the trainer
    return config, accelerator, pipe, unet, optimizer, params, negative, batches, updater


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        return run(args, bench_model(args, scratch))


def run(args, model: str) -> dict:
    config, accelerator, pipe, unet, optimizer, params, negative, batches, updater = build(args, model)
    _, train_dicts, record, records = batches  # the reference loops' dicts, ours: the trainer's batch records
    family = updater.scorer.family
    trainable = family.stochastic_steps(config.sample).nonzero().flatten().tolist()  # the SDE window's steps
    k = max(1, int(len(trainable) * args.step_fraction))  # per sample, as ours draws them (random_step_mask)
    pairs = args.samples * k * config.train.num_inner_epochs
    round_pairs = args.batch_size * k * config.train.num_inner_epochs
    reference = None if args.no_reference_loop else reference_loop(family)
    if reference == "ddpo-pytorch loop" and len(trainable) < args.steps:
        raise SystemExit(f"--sde-window-size {args.sde_window_size}: the ddpo-pytorch loop trains every step "
                         "(use 0, or --no-reference-loop)")

    def reference_epoch(train_batch, update=True):
        with eager(family.model):
            if reference == "ddpo-pytorch loop":
                return ddpo_pytorch_epoch(train_batch, unet, pipe.scheduler, optimizer, params, accelerator, negative,
                                          config, family.noise_level(config.sample), update=update)
            return flow_grpo_epoch(train_batch, unet, family, optimizer, params, accelerator, config, trainable[:k],
                                   update=update)

    check = same_loss_and_gradient(updater, reference_epoch, records[0], train_dicts[0], trainable[:k], params) \
        if reference and (reference == "Flow-GRPO loop" or k == args.steps) else None
    counter = {"ours": 0, "reference": 0}
    trained = []

    def next_batch(name):
        counter[name] += 1
        return (records if name == "ours" else train_dicts)[(counter[name] - 1) % len(records)]

    contenders = {"ours": lambda: trained.append(updater.train_epoch(next_batch("ours"), show_progress=False)["pairs"])}
    if reference:
        contenders[reference] = lambda: reference_epoch(next_batch("reference"))
    times = side_by_side(contenders, args.repeats, args.device)
    if set(trained) != {round_pairs}:  # the same (sample, step) pairs' count in every round
        raise RuntimeError(f"ours trained {sorted(set(trained))} pairs per train batch, the reference {round_pairs}")

    # the instrumented run: share of the training phase inside the denoiser's forward and backward
    timer = UNetTimer(accelerator.unwrap_model(unet), args.device)
    plain_backward = accelerator.backward
    accelerator.backward = timer.wrap_backward(plain_backward)
    sync(args.device)
    start = time.perf_counter()
    updater.train_epoch(record, show_progress=False)
    sync(args.device)
    wall = time.perf_counter() - start
    accelerator.backward = plain_backward
    timer.remove()
    share = (timer.forward_s + timer.backward_s) / wall
    chunk = updater.pairs_per_forward_of(record)

    print(f"machine: {machine(args.device)}; device {args.device}, mixed precision {args.mixed_precision}")
    window = f"{len(trainable)} stochastic" if len(trainable) < args.steps else "all stochastic"
    print(f"{family.name} ({model}): {args.samples} samples x {k} of {args.steps} steps ({window}) = {pairs} trained "
          f"(sample, step) pairs per epoch, {args.resolution} px, LoRA rank {config.lora_rank}, train.batch_size "
          f"{args.batch_size} ({args.samples // args.batch_size} optimizer steps), pairs_per_forward "
          f"{chunk}{' (auto)' if args.pairs_per_forward == 'auto' else ''}, guidance {config.sample.guidance_scale} ({'CFG' if config.train.cfg else 'no CFG'})"
          f"; {args.repeats} interleaved rounds of one train batch ({round_pairs} pairs)")
    print(f"  reference loop: {reference or 'none for this family'}"
          f"{f'; ours compiled ({args.compile_denoiser}), the reference eager' if args.compile_denoiser != 'no' else ''}")
    out = {"family": family.name, "reference": reference, "pairs": pairs, "round_pairs": round_pairs,
           "unet_share": share, "times": times, "device": args.device, "mixed_precision": args.mixed_precision,
           "resolution": args.resolution, "samples": args.samples, "steps": args.steps, "trained_steps": k,
           "batch_size": args.batch_size, "pairs_per_forward": chunk, "lora_rank": config.lora_rank,
           "compile_denoiser": args.compile_denoiser,
           "machine": machine(args.device)}
    if check is not None:
        out.update(check)
        print(f"  same pairs, one train batch before any update: loss ours {check['loss_ours']:.6g}, "
              f"{reference} {check['loss_reference']:.6g}, max |diff| {check['loss_max_abs_diff']:.2e}; LoRA "
              f"gradient max |diff| {check['grad_max_abs_diff']:.2e} (max |grad| {check['grad_max_abs']:.2e})")
    t_ours = statistics.median(times["ours"])
    out["ours_pairs_per_s"] = round_pairs / t_ours
    print(f"  ours (chunked pairs)         : median {t_ours:7.3f} s per train batch  {round_pairs / t_ours:8.1f} pairs/s")
    if reference:
        t_ref = statistics.median(times[reference])
        speedup = median_ratio(times[reference], times["ours"])
        out.update(reference_pairs_per_s=round_pairs / t_ref, speedup=speedup)
        print(f"  {reference + ' (per step)':29s}: median {t_ref:7.3f} s per train batch  {round_pairs / t_ref:8.1f} pairs/s")
        print(f"  speed-up ours / {reference.removesuffix(' loop')} (median of per-round ratios): {speedup:.2f}x  "
              f"(target >= 2x on a GPU: {'met' if speedup >= 2 else 'NOT met'}); per-round "
              + ", ".join(f"{b / a:.2f}" for a, b in zip(times["ours"], times[reference])))
    print(f"  denoiser share of our training phase: {100 * share:.1f}% (forward {timer.forward_s:.3f} s in "
          f"{timer.forwards} calls, backward {timer.backward_s:.3f} s, of {wall:.3f} s; target >= 85%: "
          f"{'met' if share >= 0.85 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"  figures written to {args.json}")
    return out


def same_loss_and_gradient(updater, reference_epoch, train_batch, train_dict, steps, params) -> dict:
    """Ours (``Updater.accumulate_gradients`` of update/updater.py, the trainer's code, on the batch record
    ``train_batch``) and the reference loop (on ``train_dict``, the same rows) on the same pairs of one train batch
    (every sample at ``steps``), before any update: both losses, and the max |difference| of the losses and of the
    accumulated LoRA gradients. The gradients are zeroed after each; no optimizer step is taken."""
    updater.model.train()
    updater.pairs_per_forward_of(train_batch)  # "auto" measured now (as train_epoch does before an update)
    rows = torch.arange(len(train_batch))
    mask = torch.zeros(train_batch.log_probs.shape)
    mask[:, steps] = 1.0
    updater.optimizer.zero_grad(set_to_none=True)
    updater.scorer.prepare(updater.config.sample.num_steps, updater.accelerator.device)
    updater.model.train()
    ours = updater.accumulate_gradients(train_batch, rows, mask)["policy_loss"].float()
    updater.model.eval()
    ours_grad = [p.grad.detach().float().clone() for p in params]
    updater.optimizer.zero_grad(set_to_none=True)
    theirs = reference_epoch(train_dict, update=False).float()
    grad_diff = max(float((p.grad.float() - g).abs().max()) for p, g in zip(params, ours_grad))
    updater.optimizer.zero_grad(set_to_none=True)
    return {"loss_ours": float(ours), "loss_reference": float(theirs), "loss_max_abs_diff": float((ours - theirs).abs()),
            "grad_max_abs_diff": grad_diff, "grad_max_abs": max(float(g.abs().max()) for g in ours_grad)}


if __name__ == "__main__":
    main()
