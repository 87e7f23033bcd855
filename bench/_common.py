"""Shared helpers of the benchmarks: threads, the machine line, side-by-side (interleaved) timing, memory."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def add_common_args(parser) -> None:
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared CPU, ratios are steadier; 0 = torch's default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def setup_threads(threads: int) -> None:
    """Set torch's thread count (0: its default), and quiet diffusers' per-call logs (the pipelines log a truncation
    warning for every long prompt of every call)."""
    if threads:
        torch.set_num_threads(threads)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()


def machine(device: str = "cpu") -> str:
    line = (f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch thread(s)")
    try:
        import diffusers

        line += f", diffusers {diffusers.__version__}"
    except ImportError:  # pragma: no cover
        pass
    if str(device).startswith("cuda") and torch.cuda.is_available():
        line += f", GPU {torch.cuda.get_device_name()}"
    return line


def sync(device) -> None:
    """Wait for queued GPU work (timing boundaries only; a no-op on the CPU)."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, device="cpu") -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def side_by_side(contenders: dict, repeats: int, device="cpu", warmup: bool = True) -> dict[str, list[float]]:
    """Run every contender ``repeats`` times, interleaved, rotating the order each round so that machine
    contention hits all of them alike. Returns {name: [seconds per round]}."""
    names = list(contenders)
    if warmup:
        for name in names:
            contenders[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            times[name].append(timed(contenders[name], device))
    return times


def median_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of the per-round ratio num / den (each round measured side by side)."""
    return statistics.median(a / b for a, b in zip(num, den))


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20


def current_rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # pragma: no cover
        return float("nan")


class UNetTimer:
    """Wall time inside a UNet's forward and backward (for the share of the training phase).

    Forward: forward pre/post hooks. Backward: from the moment the gradient reaches the UNet's output
    (a tensor hook) to the end of the enclosing backward call (``wrap_backward``); the UNet's inputs need
    no gradient, so the rest of that backward is the UNet's. On CUDA every boundary synchronizes (this
    instrumented run is separate from the timed comparison).
    """

    def __init__(self, unet, device):
        self.device = device
        self.forward_s = self.backward_s = 0.0
        self.forwards = 0
        self._grad_reached = None
        self._handles = [unet.register_forward_pre_hook(self._pre), unet.register_forward_hook(self._post)]

    def _now(self) -> float:
        sync(self.device)
        return time.perf_counter()

    def _pre(self, module, args):
        self._start = self._now()

    def _post(self, module, args, output):
        self.forward_s += self._now() - self._start
        self.forwards += 1
        out = output[0] if isinstance(output, tuple) else output.sample
        if out.requires_grad:
            out.register_hook(self._on_grad)

    def _on_grad(self, grad):
        if self._grad_reached is None:
            self._grad_reached = self._now()

    def wrap_backward(self, backward):
        def timed_backward(loss, **kwargs):
            self._grad_reached = None
            result = backward(loss, **kwargs)
            if self._grad_reached is not None:
                self.backward_s += self._now() - self._grad_reached
            return result

        return timed_backward

    def remove(self):
        for handle in self._handles:
            handle.remove()


def bench_model(args, scratch: str) -> str:
    """``--model``, else the embedded tiny-shapes (``--family sd``) or the tiny random pipeline of ``--family`` saved
    in ``scratch``."""
    if args.model:
        return args.model
    if args.family == "sd":
        return "tiny-shapes"
    from ddpo_group.models.tiny_random import TINY_BUILDERS, save_pipeline

    return save_pipeline(TINY_BUILDERS[args.family](), Path(scratch) / args.family)


def bench_config(args, model: str):
    """group_ppo's config for a bench run on ``model``: the shape (``--resolution``, ``--max-sequence-length``,
    ``--num-frames``), the guidance (the tiny FLUX's embedded 3.5 without CFG; ``--guidance``), ``--mixed-precision``,
    ``--steps`` and ``--batch-size`` (train.batch_size)."""
    from config.base import get_config

    config = get_config("group_ppo")
    config.pretrained.model = model
    config.sample.resolution, config.pretrained.max_sequence_length = args.resolution, args.max_sequence_length
    config.sample.num_frames = args.num_frames
    if args.family == "flux" and not args.model:  # FLUX.1-dev's guidance is an embedding: no unconditional forward
        config.sample.guidance_scale, config.train.cfg = 3.5, False
    if args.guidance is not None:
        config.sample.guidance_scale = args.guidance
    config.mixed_precision = args.mixed_precision
    config.sample.num_steps = args.steps
    config.train.batch_size = args.batch_size
    return config


def train_batches(cond: dict, traj, advantages: torch.Tensor, batch_size: int) -> tuple:
    """The sampled ``traj`` (sampling/trajectories.py's Trajectories) under ``cond`` with ``advantages`` [B, T], as the
    reference loops read it (a dict of tensors, ddpo-pytorch's ``samples``) and as ours does (the trainer's batch
    record, sampling/batch.py's RolloutBatch): (the dict, its train batches of ``batch_size`` samples, the record,
    its train batches of the same rows)."""
    from ddpo_group.sampling.batch import RolloutBatch

    def record(part: dict) -> RolloutBatch:
        rows = len(part["log_probs"])
        return RolloutBatch(prompts=[""] * rows, metadata=[{}] * rows, cond={key: part[key] for key in cond},
                            latents=part["latents"], next_latents=part["next_latents"], log_probs=part["log_probs"],
                            times={key: part[key] for key in traj.times}, images=torch.zeros(rows, 0),
                            rewards=torch.zeros(rows, dtype=torch.float64), reward_info={}, advantages=part["advantages"])

    batch = {**cond, "latents": traj.latents[:, :-1], "next_latents": traj.latents[:, 1:], "log_probs": traj.log_probs,
             **traj.times, "advantages": advantages}
    parts = [{key: value[i : i + batch_size] for key, value in batch.items()}
             for i in range(0, len(traj.log_probs), batch_size)]
    return batch, parts, record(batch), [record(part) for part in parts]
