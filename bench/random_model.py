"""Full-size pipelines with random weights, built from config (no download; ddpo_group/models/full_size.py, which says
what each shape holds): what the GPU benchmarks measure memory and throughput on when the real weights are not at hand.

    python bench/random_model.py --shape sd15 --out /tmp/sd15     # Stable Diffusion 1.5's shapes, 512 px
    python bench/random_model.py --shape sd35m --out /tmp/sd35m   # SD 3.5 Medium's transformer, CLIP-L/G, no T5
    python bench/random_model.py --shape sdxl --out /tmp/sdxl     # SDXL base's UNet, CLIP-L and CLIP-G, 1024 px
    python bench/random_model.py --shape zimage --out /tmp/zimage # Z-Image's 6B transformer, Qwen3-4B, FLUX VAE
    python bench/random_model.py --shape flux --out /tmp/flux     # FLUX.1 [dev]: 11.9B + T5-XXL (34 GB); --blocks 0.5: half
    python bench/random_model.py --shape flux_kontext --out /tmp/kontext  # FLUX.1 Kontext [dev]: the same in its pipeline
    python bench/random_model.py --shape flux2_klein4b --out /tmp/klein4b  # FLUX.2 [klein] 4B, Qwen3-4B, FLUX.2 VAE
    python bench/random_model.py --shape wan13b --out /tmp/wan    # Wan2.1-T2V-1.3B's transformer, VAE and UMT5-XXL
    python bench/random_model.py --shape wan21_i2v14b --out /tmp/i2v  # Wan2.1-I2V-14B, its CLIP ViT-H encoder
    python bench/random_model.py --shape qwenimage --out /tmp/qwen  # Qwen-Image (20.4B) and Qwen2.5-VL-7B: ~57 GB
    python bench/random_model.py --shape qwenimage_edit_plus --out /tmp/qwenedit  # Qwen-Image-Edit-Plus: the same
    python bench/random_model.py --shape sana --out /tmp/sana     # SANA 1.5 1.6B, its DC-AE, Gemma-2-2B
    python bench/random_model.py --shape qwenimage21 --out /tmp/q21  # Qwen-Image 2.1 and Qwen3-VL-8B
    python bench/random_model.py --shape hunyuan_video15 --out /tmp/hv15  # HunyuanVideo 1.5 480p, Qwen2.5-VL-7B, ByT5
    python bench/random_model.py --shape ltx2 --out /tmp/ltx2     # LTX-2 (18.9B), Gemma-3-12B, its VAEs and vocoder
    python bench/random_model.py --shape krea2 --out /tmp/krea2   # Krea 2 (12.8B), Qwen3-VL-4B
    python bench/random_model.py --shape ideogram4 --out /tmp/ideo  # Ideogram 4: two 9.3B transformers, Qwen3-VL-8B
    python bench/random_model.py --shape kandinsky6 --out /tmp/k6  # Kandinsky 6 (48.2B at the class defaults), audio
    python bench/random_model.py --shape hunyuan_image --out /tmp/hi  # HunyuanImage 2.1 (17.4B), Qwen2.5-VL-7B, ByT5
    python bench/random_model.py --shape sana_video --out /tmp/sv  # SANA-Video 2B, Wan2.1's VAE, Gemma-2-2B
    python bench/random_model.py --shape cosmos3 --out /tmp/c3    # Cosmos 3 (15.2B), Wan2.2's VAE, its sound tokenizer

Weights are saved in bfloat16.

    python bench/random_model.py --count-only --shape zimage wan13b [--blocks 1.0] [--json PATH]

``--count-only`` builds each shape on the meta device (no weights in memory, nothing saved: a second a shape once the
libraries are imported) and prints one JSON line a shape, its description: ``{"shape", "blocks", "pipeline": its class
name, "parameters": {component: parameter count}, "configs": {component: its config}}`` for every component that is a
torch module. ``--json PATH`` also writes those lines to PATH (with ``--out``: the saved pipeline's).
"""


from __future__ import annotations

import argparse
import inspect
import json

import torch

from ddpo_group.models.full_size import BUILDERS, describe


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(BUILDERS), nargs="+", required=True,
                        help="the shape to build (several with --count-only)")
    output = parser.add_mutually_exclusive_group(required=True)
    output.add_argument("--out", help="the folder the pipeline is saved to")
    output.add_argument("--count-only", action="store_true",
                        help="build on the meta device (no weights in memory, nothing saved) and print each shape's "
                             "parameter counts and configs per component as one JSON line")
    parser.add_argument("--blocks", type=float, default=1.0,
                        help="the fraction of the transformer's (and T5's) blocks kept, widths unchanged: flux, "
                             "flux_kontext, qwenimage_edit_plus and wan21_i2v14b")
    parser.add_argument("--json", default="", metavar="PATH", help="also write the shapes' descriptions to this file, "
                                                                  "one JSON line each")
    args = parser.parse_args(argv)
    if len(args.shape) > 1 and not args.count_only:
        parser.error(f"--shape {' '.join(args.shape)}: one shape is saved to --out (several with --count-only)")
    for shape in args.shape:
        if args.blocks != 1.0 and "blocks" not in inspect.signature(BUILDERS[shape]).parameters:
            parser.error(f"--blocks {args.blocks} applies to flux, flux_kontext, qwenimage_edit_plus and wan21_i2v14b, "
                         f"not {shape}")
    lines = []
    for shape in args.shape:
        lines.append(build(shape, args))
    if args.json:
        with open(args.json, "w") as f:
            f.write("".join(line + "\n" for line in lines))


def build(shape: str, args) -> str:
    """Build ``shape`` (``--count-only``: on the meta device, printing its description; else saved to ``--out``); its
    description as a JSON line."""
    builder = BUILDERS[shape]
    torch.manual_seed(0)
    # random init on the GPU: seconds, not minutes; the meta device allocates nothing
    device = "meta" if args.count_only else "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        pipe = builder(blocks=args.blocks) if args.blocks != 1.0 else builder()
    description = describe(shape, args.blocks, pipe)
    line = json.dumps(description, default=str)
    if args.count_only:
        print(line, flush=True)
        return line
    pipe.to(torch.bfloat16)
    counts = {name: count / 1e6 for name, count in description["parameters"].items()}
    pipe.save_pretrained(args.out)
    print(f"{shape} saved to {args.out}: " + ", ".join(f"{k} {v:.0f}M" for k, v in counts.items()))
    return line


if __name__ == "__main__":
    main()
