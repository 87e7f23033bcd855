"""The ceiling of the chunked training layout: UNet forward+backward cost per row against the rows per call.

    python bench/unet_rows.py [--rows 16,32,64,128,256] [--repeats 3] [--threads 1]

The training phase is almost all UNet forward+backward (bench/training.py prints the share), and
our layout differs from the ddpo-pytorch loop only in how many rows one call holds: 2 x
train.batch_size (16 by default) there, 2 x train.pairs_per_forward (64) here. So the best
speed-up batching can give is the per-row cost at 16 rows over the per-row cost at the larger
size. This measures it on the embedded model with the default LoRA (rank 4 on the attention
projections), the calls of every size interleaved round by round; prints ms per row and that
ratio.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _common import add_common_args, machine, setup_threads, side_by_side

from config.base import get_config
from ddpo_group.models.trainable import build_policy
from ddpo_group.models.families.sd import latent_shape


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32,64,128,256")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    add_common_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> dict[int, float]:
    args = parse_args(argv)
    setup_threads(args.threads)
    config = get_config("group_ppo")
    pipe = build_policy(config, args.device)[0].pipe
    unet = pipe.unet
    unet.train()
    sizes = [int(r) for r in args.rows.split(",")]
    generator = torch.Generator().manual_seed(0)
    inputs = {
        rows: (torch.randn(rows, *latent_shape(unet), generator=generator).to(args.device),
               torch.randint(0, 1000, (rows,), generator=generator).to(args.device),
               torch.randn(rows, 8, unet.config.cross_attention_dim, generator=generator).to(args.device))
        for rows in sizes
    }

    def step(rows):
        def run():
            x, t, e = inputs[rows]
            unet(x, t, encoder_hidden_states=e, return_dict=False)[0].square().mean().backward()
        return run

    times = side_by_side({rows: step(rows) for rows in sizes}, args.repeats, device=args.device)
    print(machine(args.device))
    base = statistics.median(times[sizes[0]]) / sizes[0]
    per_row = {}
    print(f"| rows per call | ms per row (median of {args.repeats}) | speed-up over {sizes[0]} rows |")
    print("|---:|---:|---:|")
    for rows in sizes:
        per_row[rows] = statistics.median(times[rows]) / rows
        print(f"| {rows} | {1000 * per_row[rows]:.2f} | {base / per_row[rows]:.2f}x |")
    return per_row


if __name__ == "__main__":
    main()
