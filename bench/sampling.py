"""Our log-prob sampler versus the diffusers pipeline's own __call__, side by side, for any model family.

    python bench/sampling.py [--images 64] [--steps 20] [--repeats 7] [--threads 1] [--model tiny-shapes]
    python bench/sampling.py --family sd3 [--resolution 32]     # a tiny random SD3 (or flux) built from config
    python bench/sampling.py --model DIR --device cuda --dtype bf16 --resolution 512 --json out.json

Same model, prompts, number of steps, batch, guidance, output decoded to images in both:

* ours: the trainer's sampling path, ``sample_trajectories`` with the family at the configured noise levels (the SDE
  window ``--sde-window-size``, 0: every step stochastic), recording the latents and every stochastic step's
  log-probability, the run's one-row negative condition (encoded once, as the trainer does);
* diffusers: the family's pipeline __call__ (StableDiffusionPipeline, StableDiffusion3Pipeline, FluxPipeline, ...)
  with its own sampler: DDIM at the noise level (eta, Stable Diffusion; SDXL alike), the deterministic Euler sampler on
  the flow families (the pipeline has no SDE; a stochastic step costs a few elementwise operations more).

The two contenders run interleaved (the order alternates every round) so that contention on a
shared machine hits both alike; prints the median over rounds of the per-round wall-time ratio
ours / diffusers (target: at most 1.0 on a GPU, 1.05 on the CPU). One more call of ours with the pipeline's own
sampler (DDIM's eta; noise level 0 on the flow families: deterministic) checks that both produce the same images.
A last, instrumented call of each splits its time into the models (text encoders, denoiser, VAE decoder, from
forward hooks) and the rest (the sampler's own work), which is what the two implementations differ
in and is far less sensitive to contention than the total.
On a GPU, ``--dtype fp16|bf16`` loads the model in that dtype for both. ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import add_common_args, machine, median_ratio, setup_threads, side_by_side, sync, timed

from config.base import base
from ddpo_group.models import TINY_SHAPES, load_family
from ddpo_group.models.tiny_random import TINY_BUILDERS, save_pipeline
from ddpo_group.prompts import PromptSampler
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(TINY_BUILDERS), default="sd",
                        help="without --model: the embedded tiny-shapes model (sd), or a tiny random model built from config")
    parser.add_argument("--model", default="", help="a local diffusers directory or hub id (default: see --family)")
    parser.add_argument("--num-frames", type=int, default=5, help="frames per video of a video family (wan)")
    parser.add_argument("--resolution", type=int, default=32,
                        help="pixels, SDXL and the flow families (SD: the model's size)")
    parser.add_argument("--max-sequence-length", type=int, default=16, help="T5 tokens, flow families")
    parser.add_argument("--prompt-fn", default="tiny_shapes")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--noise_level", type=float, default=None, help="sample.noise_level: DDIM's eta (Stable "
                        "Diffusion), the flow SDE's a (default: the family's standard level, 1 and 0.7)")
    parser.add_argument("--sde-window-size", type=int, default=0, help="sample.sde_window_size of ours: the first N "
                        "steps stochastic (0: every step)")
    parser.add_argument("--json", default="", help="write the measured figures to this JSON file")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    add_common_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or (TINY_SHAPES if args.family == "sd" else
                               save_pipeline(TINY_BUILDERS[args.family](), Path(scratch) / args.family))
        return run(args, model)


def run(args, model: str) -> dict:
    dtype = DTYPES[args.dtype]
    config = base()  # every field at its default (config/base.py), the benchmark's choices on top
    config.sample.resolution, config.sample.num_frames = args.resolution, args.num_frames
    config.sample.sde_type, config.sample.noise_level = "flow_sde", args.noise_level
    config.sample.guidance_scale = args.guidance
    config.pretrained.max_sequence_length = args.max_sequence_length
    config.sample.num_steps = args.steps
    config.sample.sde_window_start, config.sample.sde_window_size = 0, args.sde_window_size
    family = load_family(model, torch_dtype=dtype, family="" if args.model else args.family, config=config)
    pipe = family.pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    prompts, _ = PromptSampler(args.prompt_fn, seed=0).sample(args.images)
    kwargs = dict(num_inference_steps=args.steps, guidance_scale=args.guidance,
                  **family.pipeline_kwargs(config.sample, config.pretrained))
    pipeline_noise = [kwargs.get("eta", 0.0)] * args.steps  # the pipeline's sampler: DDIM at its eta, or Euler
    noise_levels = family.noise_levels(config.sample)  # the trainer's: the SDE window at the noise level
    results = {}

    @torch.no_grad()
    def diffusers_call():
        generator = torch.Generator(args.device).manual_seed(0)
        out = pipe(prompts, output_type="pt", generator=generator, **kwargs)
        results["diffusers"] = out.frames if hasattr(out, "frames") else out.images  # video: frames

    @torch.no_grad()
    def ours():
        generator = torch.Generator(args.device).manual_seed(0)
        traj = sample_trajectories(family, family.model, family.encode(prompts), family.negative_condition(),
                                   SamplingOptions(args.steps, args.guidance, noise_levels,
                                                   log_prob_reduce=config.sample.log_prob_reduce,
                                                   compute_log_prob=any(level > 0 for level in noise_levels)),
                                   generator=generator)
        results["ours"] = traj.images

    @torch.no_grad()
    def ours_as_the_pipeline():
        """Ours with the pipeline's own sampler and its batched negative condition (the pipeline encodes its empty
        prompt once per image): the same images."""
        generator = torch.Generator(args.device).manual_seed(0)
        negative = family.negative_condition()  # SDXL base's is zeros (force_zeros_for_empty_prompt), used as it is
        if any(bool(value.any()) for value in negative.values()):
            negative = family.encode([family.negative_prompt] * len(prompts))
        return sample_trajectories(family, family.model, family.encode(prompts), negative,
                                   SamplingOptions(args.steps, args.guidance, pipeline_noise,
                                                   compute_log_prob=any(level > 0 for level in pipeline_noise)),
                                   generator=generator).images

    times = side_by_side({"diffusers": diffusers_call, "ours": ours}, args.repeats, args.device)
    outside = {name: outside_models(family, fn, args.device) for name, fn in (("diffusers", diffusers_call), ("ours", ours))}
    ratio = median_ratio(times["ours"], times["diffusers"])
    max_diff = float((ours_as_the_pipeline().float() - results["diffusers"].float()).abs().max())
    t_diff, t_ours = statistics.median(times["diffusers"]), statistics.median(times["ours"])
    print(f"machine: {machine(args.device)}; device {args.device}, dtype {args.dtype}")
    pipeline_sampler = f"DDIM eta {pipeline_noise[0]}" if "eta" in kwargs else "Euler (noise level 0)"
    stochastic = sum(level > 0 for level in noise_levels)
    our_sampler = (f"{pipeline_sampler if 'eta' in kwargs else config.sample.sde_type + ' at ' + str(max(noise_levels))}"
                   f" on {stochastic} of {args.steps} steps, log-probs recorded" if stochastic else pipeline_sampler)
    print(f"{family.name} ({model}): {args.images} images, {args.resolution} px, {args.steps} steps, guidance "
          f"{args.guidance}, decoded; {args.repeats} interleaved rounds")
    print(f"  diffusers {type(pipe).__name__}.__call__ ({pipeline_sampler}): median {t_diff:7.3f} s")
    print(f"  ddpo_group sample_trajectories ({our_sampler}): median {t_ours:7.3f} s")
    print(f"  ratio ours / diffusers (median of per-round ratios): {ratio:.3f}  "
          f"(target <= 1.0 on a GPU: {'met' if ratio <= 1.0 else 'NOT met'}); per-round "
          + ", ".join(f"{a / b:.3f}" for a, b in zip(times['ours'], times['diffusers'])))
    low = "" if args.dtype == "fp32" or "eta" in kwargs else (
        f" ({args.dtype}: FlowMatchEulerDiscreteScheduler.step multiplies dt * v in {args.dtype}, ours in float32: "
        "not bitwise; equal in fp32)")
    print(f"  same images (ours with the pipeline's {pipeline_sampler}): max |ours - diffusers| = {max_diff:.2e}{low}")
    print("  time outside the models (text encoders, denoiser, VAE decoder), one instrumented call each: "
          + ", ".join(f"{name} {total - models:.3f} s of {total:.3f} s" for name, (total, models) in outside.items()))
    out = {"family": family.name, "ratio": ratio, "diffusers_s": t_diff, "ours_s": t_ours, "max_image_diff": max_diff,
           "times": times, "outside_models_s": {name: total - models for name, (total, models) in outside.items()},
           "images": args.images, "steps": args.steps, "stochastic_steps": stochastic, "resolution": args.resolution,
           "guidance": args.guidance, "dtype": args.dtype, "device": args.device, "machine": machine(args.device)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"  figures written to {args.json}")
    return out


def outside_models(family, fn, device) -> tuple[float, float]:
    """(total seconds, seconds inside the text encoders, the denoiser and the VAE decoder) of one call of ``fn``."""
    inside, starts, handles = [0.0], {}, []
    modules = [getattr(family.pipe, name, None) for name in ("text_encoder", "text_encoder_2", "text_encoder_3")]
    for module in [m for m in modules if m is not None] + [family.model, family.pipe.vae.decoder]:
        def pre(m, args, key=id(module)):
            sync(device)
            starts[key] = time.perf_counter()

        def post(m, args, output, key=id(module)):
            sync(device)
            inside[0] += time.perf_counter() - starts[key]

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        total = timed(fn, device)
    finally:
        for handle in handles:
            handle.remove()
    return total, inside[0]


if __name__ == "__main__":
    main()
