"""Our log-prob sampler versus diffusers' StableDiffusionPipeline.__call__, side by side.

    python bench/sampling.py [--images 64] [--steps 20] [--repeats 7] [--threads 1] [--model tiny-shapes]

Same model, prompts, number of DDIM steps, batch, CFG (5) and eta (1), output decoded to images in
both. The two contenders run interleaved (the order alternates every round) so that contention on a
shared machine hits both alike; prints the median over rounds of the per-round wall-time ratio
ours / diffusers (target: at most 1.05) and checks that both produce the same images. A last,
instrumented call of each splits its time into the models (text encoder, UNet, VAE decoder, from
forward hooks) and the rest (the sampler's own work), which is what the two implementations differ
in and is far less sensitive to contention than the total.
On a GPU, ``--dtype fp16|bf16`` loads the model in that dtype for both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import add_common_args, machine, median_ratio, setup_threads, side_by_side, sync, timed

from ddpo_group.models import TINY_SHAPES, load_pipeline
from ddpo_group.prompts import PromptSampler
from ddpo_group.models.families.sd import encode_prompts, ensure_ddim, sample_with_logprob

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_SHAPES)
    parser.add_argument("--prompt-fn", default="tiny_shapes")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--eta", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    add_common_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup_threads(args.threads)
    dtype = DTYPES[args.dtype]
    pipe = ensure_ddim(load_pipeline(args.model, torch_dtype=dtype)).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    prompts, _ = PromptSampler(args.prompt_fn, seed=0).sample(args.images)
    kwargs = dict(num_inference_steps=args.steps, guidance_scale=args.guidance, eta=args.eta)
    results = {}

    @torch.no_grad()
    def diffusers_call():
        generator = torch.Generator(args.device).manual_seed(0)
        results["diffusers"] = pipe(prompts, output_type="pt", generator=generator, **kwargs).images

    @torch.no_grad()
    def ours():
        generator = torch.Generator(args.device).manual_seed(0)
        embeds = encode_prompts(pipe, prompts)
        negative = encode_prompts(pipe, [""]).expand(len(prompts), -1, -1)
        results["ours"] = sample_with_logprob(pipe, embeds, negative, args.steps, args.guidance, args.eta,
                                              generator=generator).images

    times = side_by_side({"diffusers": diffusers_call, "ours": ours}, args.repeats, args.device)
    outside = {name: outside_models(pipe, fn, args.device) for name, fn in (("diffusers", diffusers_call), ("ours", ours))}
    ratio = median_ratio(times["ours"], times["diffusers"])
    max_diff = float((results["ours"].float() - results["diffusers"].float()).abs().max())
    t_diff, t_ours = statistics.median(times["diffusers"]), statistics.median(times["ours"])
    print(f"machine: {machine(args.device)}; device {args.device}, dtype {args.dtype}")
    print(f"{args.images} images, {args.steps} DDIM steps, CFG {args.guidance}, eta {args.eta}, decoded; "
          f"{args.repeats} interleaved rounds")
    print(f"  diffusers StableDiffusionPipeline.__call__ : median {t_diff:7.3f} s")
    print(f"  ddpo_group sample_with_logprob             : median {t_ours:7.3f} s")
    print(f"  ratio ours / diffusers (median of per-round ratios): {ratio:.3f}  "
          f"(target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'}); per-round "
          + ", ".join(f"{a / b:.3f}" for a, b in zip(times['ours'], times['diffusers'])))
    print(f"  same images: max |ours - diffusers| = {max_diff:.2e}")
    print("  time outside the models (text encoder, UNet, VAE decoder), one instrumented call each: "
          + ", ".join(f"{name} {total - models:.3f} s of {total:.3f} s" for name, (total, models) in outside.items()))
    return {"ratio": ratio, "diffusers_s": t_diff, "ours_s": t_ours, "max_image_diff": max_diff, "times": times,
            "outside_models_s": {name: total - models for name, (total, models) in outside.items()}}


def outside_models(pipe, fn, device) -> tuple[float, float]:
    """(total seconds, seconds inside the text encoder, UNet and VAE decoder) of one call of ``fn``."""
    inside, starts, handles = [0.0], {}, []
    for module in (pipe.text_encoder, pipe.unet, pipe.vae.decoder):
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
