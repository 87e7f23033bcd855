"""How long the embedded tiny-shapes model takes to sample 64 images (20 DDIM steps, CFG 5, decoded).

    python bench/tiny_sampling_speed.py [--repeats 3] [--threads N]

Target (issue 3): at most 8 seconds on a 2-core CPU. Times diffusers' StableDiffusionPipeline.__call__
and our log-prob sampler on the same prompts; prints the median of the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_group.models import TINY_SHAPES, load_pipeline  # noqa: E402
from ddpo_group.prompts import PromptSampler  # noqa: E402
from ddpo_group.sampling.pipeline import encode_prompts, sample_with_logprob  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline(TINY_SHAPES)
    pipe.set_progress_bar_config(disable=True)
    prompts, _ = PromptSampler("tiny_shapes", seed=0).sample(args.images)

    def diffusers_call():
        with torch.no_grad():
            pipe(prompts, num_inference_steps=args.steps, guidance_scale=5.0, eta=1.0, output_type="pt",
                 generator=torch.Generator().manual_seed(0))

    def ours():
        embeds = encode_prompts(pipe, prompts)
        negative = encode_prompts(pipe, [""]).expand(len(prompts), -1, -1)
        sample_with_logprob(pipe, embeds, negative, args.steps, 5.0, 1.0, generator=torch.Generator().manual_seed(0))

    t_diffusers = median_seconds(diffusers_call, args.repeats)
    t_ours = median_seconds(ours, args.repeats)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{args.images} images, {args.steps} DDIM steps, CFG 5, decoded, median of {args.repeats}:")
    print(f"  diffusers StableDiffusionPipeline.__call__ : {t_diffusers:6.2f} s  (target <= 8 s: "
          f"{'met' if t_diffusers <= 8 else 'NOT met'})")
    print(f"  ddpo_group sample_with_logprob             : {t_ours:6.2f} s  (ratio to diffusers {t_ours / t_diffusers:.3f})")


if __name__ == "__main__":
    main()
