"""The speed options of the denoiser, each against the default side by side: training-phase pairs/s, sampling-phase
images/s, their ratios and MFU, the first-call (compilation) seconds, and the log-probs of the same pairs.

    python bench/speed_options.py [--family sd|sd3|flux] [--model DIR] [--mixed-precision bf16] [--options a,b]
                                  [--resolution 512] [--json PATH]

One policy is built as the trainer builds it (build_policy: the pipeline in the mixed-precision dtype, float32 LoRA),
trajectories are recorded once, and every option is a contender beside the baseline (the policy as built, torch's
attention choice, no compilation), interleaved round by round (bench/_common.py side_by_side; the ratio is the median of
the per-round ratios option / baseline of the throughput, > 1 faster):

* training: PolicyUpdater.train_epoch on one train batch a round (as bench/training.py), pairs/s;
* sampling: sample_trajectories of ``--images`` prompts, ``--steps`` steps, CFG, decoded (the sampling phase without
  the reward), images/s.

Options (``--options``, default all):
  compile_regional  compile_denoiser="regional": torch.compile of every repeated block (diffusers'
                    compile_repeated_blocks)
  compile_full      compile_denoiser="full": torch.compile of the whole denoiser
  sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math
                    attention_backend=...: that SDPA kernel, and the math one for the calls it cannot run (e.g. the
                    VAE's one 512-channel head under flash); torch's switches (torch.backends.cuda.enable_*_sdp)
  fused_qkv         diffusers' fuse_qkv_projections. It bypasses LoRA adapters on to_q / to_k / to_v (the fused
                    to_qkv is a plain Linear holding the base weights), so with LoRA only the frozen forward is
                    measured: sampling with the adapters disabled, against the baseline with them disabled (the
                    reference model's forward); its training row needs full fine-tuning (--full-finetune)
  cuda_graphs       cuda_graphs=True: the sampling steps through a copy of the denoiser compiled with
                    torch.compile(mode="reduce-overhead") (CUDA graphs), sampling only; beside compile_regional in one
                    run, the two sampling ratios compare them
  channels_last     unet_channels_last=True (UNets only)
  fp32_frozen       the frozen weights in float32 instead of the mixed-precision dtype (build_policy keeps them in
                    bf16 / fp16 beside float32 LoRA): a ratio below 1 is what the default saves

A compiled option's first calls compile: "first s" is the seconds they took above the steady state (training and
sampling calls together), "pays back" the epochs after which its saving has repaid them: an epoch of --epoch-images
images sampled in --epoch-steps steps, every step trained (the saving per image scaled from --steps to --epoch-steps).
Numerics: the option's log-probs of the same training pairs (the training forward) and of the same sampled trajectory
(same noise) against the baseline's, max |difference| / max |baseline|, within --tolerance (default: by precision).
An option that cannot run on the device is printed as skipped with the reason; one that fails, with its error.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.nn.attention import sdpa_kernel

from _common import (add_common_args, bench_config, bench_model, machine, median_ratio, setup_threads, side_by_side,
                     sync, train_batches)

from ddpo_group.models.speed_options import attention_backends, compile_denoiser, sampling_denoiser, shared_copy
from ddpo_group.models.tiny_random import TINY_BUILDERS
from ddpo_group.models.trainable import build_policy, make_optimizer
from ddpo_group.prompts import PromptSampler
from ddpo_group.run.reporting.throughput import device_peak_flops, measure_model_flops
from ddpo_group.sampling.trajectories import SamplingOptions, TransitionScorer, sample_trajectories
from ddpo_group.update.policy_update import PolicyUpdater
from ddpo_group.update.updater import UpdateOptions

OPTIONS = ("compile_regional", "compile_full", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "fused_qkv",
           "cuda_graphs", "channels_last", "fp32_frozen")
# relative log-prob difference allowed: float32 kernels reorder sums (~1e-6); bf16 / fp16 round every activation
TOLERANCE = {"no": 1e-4, "fp16": 2e-2, "bf16": 5e-2}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(TINY_BUILDERS), default="sd",
                        help="without --model: tiny-shapes (sd) or a tiny random model built from config")
    parser.add_argument("--model", default="", help="a saved diffusers pipeline (bench/random_model.py --out DIR)")
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, of {', '.join(OPTIONS)}")
    parser.add_argument("--resolution", type=int, default=32, help="pixels, SDXL and the flow families")
    parser.add_argument("--max-sequence-length", type=int, default=16, help="T5 / LLM tokens, flow families (SD3: 256 "
                        "is its pipeline's default)")
    parser.add_argument("--num-frames", type=int, default=5, help="frames per video of a video family (wan)")
    parser.add_argument("--prompt-fn", default="tiny_shapes")
    parser.add_argument("--samples", type=int, default=8, help="recorded trajectories (train batches of --batch-size)")
    parser.add_argument("--images", type=int, default=4, help="images per sampling call")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4, help="train.batch_size")
    parser.add_argument("--pairs-per-forward", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per option and phase")
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    parser.add_argument("--full-finetune", action="store_true", help="use_lora=False (the whole denoiser trained)")
    parser.add_argument("--guidance", type=float, default=None, help="sample.guidance_scale (default: config/base.py's; "
                        "the tiny FLUX: 3.5, its guidance embedding, no CFG)")
    parser.add_argument("--epoch-images", type=int, default=64, help="images of the epoch the compile cost is "
                        "repaid over")
    parser.add_argument("--epoch-steps", type=int, default=20, help="sampling steps of that epoch (all trained)")
    parser.add_argument("--tolerance", type=float, default=None, help="relative log-prob difference allowed")
    parser.add_argument("--json", default="", help="write the measured figures here")
    add_common_args(parser)
    args = parser.parse_args(argv)
    args.options = [o.strip() for o in args.options.split(",") if o.strip()]
    unknown = [o for o in args.options if o not in OPTIONS]
    if unknown:
        parser.error(f"--options: unknown {unknown}; the options are {', '.join(OPTIONS)}")
    return args


class Skip(Exception):
    """An option that does not apply here (the reason is printed)."""


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        return Bench(args, bench_model(args, scratch)).run()


class Bench:
    def __init__(self, args, model: str):
        self.args = args
        config = bench_config(args, model)
        config.use_lora = not args.full_finetune
        config.train.pairs_per_forward = args.pairs_per_forward
        self.config = config
        self.accelerator = accelerator = Accelerator(cpu=args.device == "cpu", mixed_precision=args.mixed_precision)
        self.device = accelerator.device
        self.family, self.params = build_policy(config, self.device)
        self.model = self.family.model
        self.optimizer = accelerator.prepare_optimizer(make_optimizer(config, self.params))
        self.scorer = TransitionScorer.from_config(config, self.family)
        self.negative = self.family.negative_condition()
        self.noise_levels = self.family.noise_levels(config.sample)
        prompts, _ = PromptSampler(args.prompt_fn, seed=0).sample(args.samples)
        cond = self.family.encode(prompts)
        with torch.no_grad(), accelerator.autocast():
            traj = sample_trajectories(self.family, self.model, cond, self.negative,
                                       SamplingOptions(args.steps, config.sample.guidance_scale, self.noise_levels,
                                                       decode=False),
                                       generator=torch.Generator(self.device).manual_seed(0))
        advantages = torch.randn(args.samples, 1, generator=torch.Generator().manual_seed(0))
        _, _, self.batch, self.train_batches = train_batches(
            cond, traj, advantages.expand(-1, args.steps).contiguous().to(self.device), args.batch_size)
        self.sample_cond = {key: value[: args.images] for key, value in cond.items()}
        # the pairs whose log-probs are compared: one training forward's worth of (sample, step) pairs
        pairs = [(r, s) for r in range(args.samples) for s in range(args.steps)][: args.pairs_per_forward]
        self.rows = torch.tensor([r for r, _ in pairs], device=self.device)
        self.steps = torch.tensor([s for _, s in pairs], device=self.device)
        self.round_pairs = args.batch_size * args.steps * config.train.num_inner_epochs
        self.peak, _ = device_peak_flops(self.device, args.mixed_precision)
        self.flops = None
        if self.peak is not None:
            self.flops = measure_model_flops(self.scorer, self.model, self.batch, self.params, 0,
                                             config.sample.guidance_scale, args.steps, False, accelerator.autocast)
        self.updater(self.model).train_epoch(self.train_batches[0], show_progress=False)  # warm: allocations, kernels
        self.sample(self.model, nullcontext)
        self.tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[args.mixed_precision]

    # ------------------------------------------------------------------ contenders
    def updater(self, model, optimizer=None, params=None) -> PolicyUpdater:
        return PolicyUpdater(UpdateOptions(self.config, self.accelerator, model, optimizer or self.optimizer,
                                           params or self.params, self.scorer))

    def own_updater(self, model) -> PolicyUpdater:
        """An updater with its own optimizer (a copy with weights of its own)."""
        params = [p for p in model.parameters() if p.requires_grad]
        return self.updater(model, self.accelerator.prepare_optimizer(make_optimizer(self.config, params)), params)

    def option(self, name: str) -> dict:
        """{"model", "updater" (None: training not measured, "train_skip" says why), "context", "sample_model",
        "baseline_sample_model", "note"} of option ``name``; raises Skip when it does not apply here."""
        cuda = self.device.type == "cuda"
        base = {"model": None, "updater": None, "context": nullcontext, "sample_model": None,
                "baseline_sample_model": self.model, "train_skip": "", "note": ""}
        unet = self.family.model_attribute == "unet"
        if name in ("compile_regional", "compile_full"):
            model = shared_copy(self.model)
            compile_denoiser(model, name.split("_")[1])
            return {**base, "model": model, "updater": self.updater(model), "sample_model": model}
        if name.startswith("sdpa_"):
            backend = name.split("_")[1]
            try:
                allowed = attention_backends(backend, self.device)
            except ValueError as error:
                raise Skip(str(error)) from None
            if cuda and backend in ("flash", "cudnn") and self.args.mixed_precision == "no":
                raise Skip(f"the {backend} kernel needs fp16 / bf16 inputs (--mixed-precision)")
            return {**base, "model": self.model, "updater": self.updater(self.model),
                    "context": lambda: sdpa_kernel(list(allowed)), "sample_model": self.model}
        if name == "fused_qkv":
            model = shared_copy(self.model)
            if not hasattr(model, "fuse_qkv_projections"):
                raise Skip(f"{type(model).__name__} has no fuse_qkv_projections")
            if getattr(model.config, "dual_attention_layers", ()):  # diffusers 0.42.1: AttributeError on the GPU run
                raise Skip("diffusers' fused joint processor needs the text stream in every attention, and SD3.5-M's "
                           "second attention (dual_attention_layers) has none")
            if self.config.use_lora:  # the frozen forward only: both without their adapters
                frozen = shared_copy(self.model)
                frozen.disable_adapters()
                model.disable_adapters()
                for param in self.params:  # peft's switch froze the adapters the copies share: the baseline trains them
                    param.requires_grad_(True)
                model.fuse_qkv_projections()
                return {**base, "model": model, "sample_model": model, "baseline_sample_model": frozen,
                        "train_skip": "LoRA on to_q/to_k/to_v is bypassed by the fused to_qkv",
                        "note": "sampling: the frozen denoiser (adapters off) against the same, unfused"}
            model.fuse_qkv_projections()
            return {**base, "model": model, "updater": self.own_updater(model), "sample_model": model}
        if name == "cuda_graphs":
            if not cuda:
                raise Skip("CUDA graphs need CUDA")
            model = sampling_denoiser(self.model, cuda_graphs=True)  # the trainer's cuda_graphs=True
            return {**base, "model": model, "sample_model": model,
                    "train_skip": "sampling only (the no-grad forward of the sampling steps)"}
        if name == "channels_last":
            if not unet:
                raise Skip(f"a UNet option; the {self.family.name} denoiser is a transformer")
            model = copy.deepcopy(self.model).to(memory_format=torch.channels_last)
            return {**base, "model": model, "updater": self.own_updater(model), "sample_model": model}
        if name == "fp32_frozen":
            if self.args.mixed_precision == "no":
                raise Skip("without mixed precision every weight is float32 already")
            model = copy.deepcopy(self.model)
            torch.nn.Module.to(model, dtype=torch.float32)
            return {**base, "model": model, "updater": self.own_updater(model), "sample_model": model,
                    "note": "a ratio < 1: what the default (frozen weights in the mixed-precision dtype) saves"}
        raise AssertionError(name)

    # ------------------------------------------------------------------ measurements
    def train_log_probs(self, model, context) -> torch.Tensor:
        model.train()
        with context(), self.accelerator.autocast():
            self.scorer.prepare(self.args.steps, self.device)
            out = self.scorer(model, self.batch, self.rows, self.steps).log_prob.detach().float()
        model.eval()
        return out

    def sample(self, model, context):
        with torch.no_grad(), context(), self.accelerator.autocast():
            return sample_trajectories(self.family, model, self.sample_cond, self.negative,
                                       SamplingOptions(self.args.steps, self.config.sample.guidance_scale,
                                                       self.noise_levels, decode=True),
                                       generator=torch.Generator(self.device).manual_seed(1))

    def timed(self, fn) -> tuple[float, object]:
        sync(self.device)
        start = time.perf_counter()
        out = fn()
        sync(self.device)
        return time.perf_counter() - start, out

    def measure(self, name: str) -> dict:
        o = self.option(name)
        row = {"option": name, "note": o["note"], "train_skip": o["train_skip"]}
        relative = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))  # noqa: E731
        first = 0.0  # seconds of the option's first calls above the steady state
        counter = {"baseline": 0, "option": 0}

        def train(key, updater):
            def go():
                counter[key] += 1
                updater.train_epoch(self.train_batches[(counter[key] - 1) % len(self.train_batches)],
                                    show_progress=False)
            return go

        # sampling: the first calls (compilation), the same noise's log-probs, then the interleaved rounds
        base_model, model, context = o["baseline_sample_model"], o["sample_model"], o["context"]
        t_base, base_traj = self.timed(lambda: self.sample(base_model, nullcontext))
        t_first, traj = self.timed(lambda: self.sample(model, context))
        row["sample_logprob_rel_diff"] = relative(traj.log_probs.float(), base_traj.log_probs.float())
        times = side_by_side({"baseline": lambda: self.sample(base_model, nullcontext),
                              "option": lambda: self.sample(model, context)}, self.args.repeats, self.device,
                             warmup=False)
        first += t_first - statistics.median(times["option"])
        images = self.args.images
        row["sample_images_per_s"] = images / statistics.median(times["option"])
        row["baseline_sample_images_per_s"] = images / statistics.median(times["baseline"])
        row["sample_ratio"] = median_ratio(times["baseline"], times["option"])
        if self.flops is not None:
            row["sample_mfu"] = row["sample_images_per_s"] * self.flops.sample_per_image / self.peak

        if o["updater"] is not None:  # training: the training forward's log-probs, the first call, the rounds
            base_lp = self.train_log_probs(self.model, nullcontext)
            t_lp, lp = self.timed(lambda: self.train_log_probs(o["model"], context))
            row["train_logprob_rel_diff"] = relative(lp, base_lp)
            first += t_lp - self.timed(lambda: self.train_log_probs(o["model"], context))[0]
            baseline_updater = self.updater(self.model)
            option_train = train("option", o["updater"])
            t_first, _ = self.timed(lambda: _within(context, option_train))
            times = side_by_side({"baseline": train("baseline", baseline_updater),
                                  "option": lambda: _within(context, option_train)}, self.args.repeats, self.device,
                                 warmup=False)
            first += t_first - statistics.median(times["option"])
            row["train_pairs_per_s"] = self.round_pairs / statistics.median(times["option"])
            row["baseline_train_pairs_per_s"] = self.round_pairs / statistics.median(times["baseline"])
            row["train_ratio"] = median_ratio(times["baseline"], times["option"])
            if self.flops is not None:
                row["train_mfu"] = row["train_pairs_per_s"] * self.flops.train_per_pair / self.peak
        if name.startswith("compile") or name == "cuda_graphs":
            row["first_call_s"] = max(first, 0.0)
            per_epoch = self.saved_per_epoch(row)
            row["saved_s_per_epoch"] = per_epoch
            row["pays_back_epochs"] = row["first_call_s"] / per_epoch if per_epoch > 0 else None
        return row

    def saved_per_epoch(self, row: dict) -> float:
        """Seconds the option saves in an epoch of --epoch-images images of --epoch-steps steps, all trained."""
        args = self.args
        images, steps = args.epoch_images, args.epoch_steps
        saved = images * steps / args.steps * (1 / row["baseline_sample_images_per_s"] - 1 / row["sample_images_per_s"])
        if "train_pairs_per_s" in row:
            saved += images * steps * (1 / row["baseline_train_pairs_per_s"] - 1 / row["train_pairs_per_s"])
        return saved

    def run(self) -> dict:
        args = self.args
        rows = []
        for name in args.options:
            try:
                rows.append(self.measure(name))
            except Skip as reason:
                rows.append({"option": name, "skipped": str(reason)})
            except Exception as error:  # an option failing on this device is a result, not the end of the bench
                rows.append({"option": name, "failed": f"{type(error).__name__}: {str(error)[:300]}"})
            finally:
                torch._dynamo.reset()  # compiled code of one option is not reused by the next
        result = {"machine": machine(args.device), "device": str(self.device), "family": self.family.name,
                  "mixed_precision": args.mixed_precision, "use_lora": self.config.use_lora,
                  "tolerance": self.tolerance, "rows": rows}
        if self.flops is not None:
            result.update(tflop_per_pair=self.flops.train_per_pair / 1e12,
                          tflop_per_image=self.flops.sample_per_image / 1e12)
        measured = [r for r in rows if "sample_ratio" in r]
        if measured:  # the baseline's figures: the median over the rows' side-by-side baselines
            train = [r["baseline_train_pairs_per_s"] for r in measured if "baseline_train_pairs_per_s" in r]
            base = {"sample_images_per_s": statistics.median(r["baseline_sample_images_per_s"] for r in measured)}
            if train:
                base["train_pairs_per_s"] = statistics.median(train)
            if self.flops is not None:
                base["sample_mfu"] = base["sample_images_per_s"] * self.flops.sample_per_image / self.peak
                if train:
                    base["train_mfu"] = base["train_pairs_per_s"] * self.flops.train_per_pair / self.peak
            result["baseline"] = base
        self.report(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return result

    def report(self, result: dict) -> None:
        args = self.args
        print(f"machine: {result['machine']}; device {self.device}, mixed precision {args.mixed_precision}")
        print(f"{self.family.name} ({self.config.pretrained.model}), {'LoRA' if self.config.use_lora else 'full'}: "
              f"training {args.batch_size} samples x {args.steps} steps = {self.round_pairs} pairs per train batch, "
              f"pairs_per_forward {args.pairs_per_forward}; sampling {args.images} images x {args.steps} steps, "
              f"CFG {self.config.sample.guidance_scale}, decoded; {args.repeats} interleaved rounds per phase; ratio: "
              f"option / baseline throughput (median of per-round ratios); log-prob tolerance {self.tolerance:g}; pays back: "
              f"epochs of {args.epoch_images} images x {args.epoch_steps} steps, all trained")
        def fmt(value, spec):  # "n/a" right-aligned to the spec's width
            width = spec.split(".")[0]
            return format("n/a", f">{width}") if value is None else format(value, spec)

        head = (f"{'option':<17}{'train pairs/s':>14}{'ratio':>7}{'MFU':>7}{'sample img/s':>14}{'ratio':>7}"
                f"{'MFU':>7}{'first s':>9}{'pays back':>10}  log-prob rel diff (train, sample)")
        print(head)
        for row in result["rows"]:
            name = row["option"]
            if "skipped" in row or "failed" in row:
                print(f"{name:<17}{'skipped: ' + row['skipped'] if 'skipped' in row else 'FAILED: ' + row['failed']}")
                continue
            diffs = [row.get("train_logprob_rel_diff"), row["sample_logprob_rel_diff"]]
            within = all(d <= self.tolerance for d in diffs if d is not None)
            print(f"{name:<17}{fmt(row.get('train_pairs_per_s'), '14.2f')}{fmt(row.get('train_ratio'), '7.2f')}"
                  f"{fmt(row.get('train_mfu'), '7.1%')}{row['sample_images_per_s']:14.3f}{row['sample_ratio']:7.2f}"
                  f"{fmt(row.get('sample_mfu'), '7.1%')}{fmt(row.get('first_call_s'), '9.1f')}"
                  f"{fmt(row.get('pays_back_epochs'), '10.1f')}  "
                  f"{fmt(diffs[0], '.1e')}, {diffs[1]:.1e} {'ok' if within else 'OUTSIDE tolerance'}"
                  + (f"; training: {row['train_skip']}" if row["train_skip"] else "")
                  + (f"; {row['note']}" if row["note"] else ""))
        base = result.get("baseline")
        if base:
            print(f"baseline (median over the rows): training {fmt(base.get('train_pairs_per_s'), '.2f')} pairs/s, "
                  f"MFU {fmt(base.get('train_mfu'), '.1%')}; sampling {base['sample_images_per_s']:.3f} images/s, "
                  f"MFU {fmt(base.get('sample_mfu'), '.1%')}" + ("" if self.flops else " (MFU: not a GPU in PEAK_TFLOPS)"))


def _within(context, fn):
    with context():
        fn()


if __name__ == "__main__":
    main()
