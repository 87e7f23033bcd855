"""Throughput of an epoch: images sampled and (sample, step) pairs trained per second, peak memory, and on CUDA the
model FLOP utilisation (MFU). One record per epoch, all processes together:

    perf/images_per_s          = I / time/sampling      I = perf/images_sampled: images sampled by every process in
                                                          every round of the epoch (ReMax's greedy samples included)
    perf/pairs_per_s           = P / time/training      P = perf/pairs_trained: (sample, step) pairs trained by every
                                                          process, num_inner_epochs passes counted
    perf/rss_gb                = max over processes of the peak resident set size since the process started (GiB)
    perf/cuda_max_allocated_gb = max over processes of torch.cuda.max_memory_allocated since the epoch began (GiB,
                                 CUDA only)
    perf/mfu_training          = P * F_pair  / (time/training * N * peak)   (CUDA, GPU in PEAK_TFLOPS)
    perf/mfu_sampling          = I * F_image / (time/sampling * N * peak)

with N the number of processes (one device each) and peak one device's dense tensor-core FLOP/s for the compute dtype
(bf16 / fp16 under mixed precision, tf32 or fp32 without). The times are the main process's wall times without
device synchronisation (processes meet at every gather, so they are the epoch's); the training phase ends with a
sync, so its time includes its GPU work.

F_pair and F_image are counted once per run with torch.utils.flop_counter.FlopCounterMode (matrix products,
convolutions and fused attention, 2 FLOPs per multiply-add; elementwise ops are not counted) on one recorded transition:

    F_pair  = one training forward + backward of the denoiser on one (sample, step) pair, with CFG's doubled rows when
              train.cfg, backward w.r.t. the trainable parameters (with LoRA: activation gradients through the frozen
              weights, weight gradients of the adapters only); + one no-grad forward when the KL to the reference is in
              the loss (the reference's forward)
    F_image = sample.num_steps forwards of the denoiser with the sampling guidance (CFG's rows)

The VAE, the text encoders, the reward and the critic are not counted, nor gradient checkpointing's recomputation:
model FLOPs, not hardware FLOPs.

Denoiser evaluations (the work a budget counts, whatever the device), every process together:

    perf/nfe_sampling  = rows through a denoiser forward while sampling and scoring the epoch (rollouts, ReMax's greedy
                         samples, the KL in the reward; CFG's two rows per sample count two)
    perf/nfe_training  = rows through a denoiser forward in the update (the policy's, and the no-grad forwards of the
                         reference and the old model; the memory probe's trial forwards included)
    perf/nfe_backward  = of those, the rows backpropagated (forwards with gradients)
    perf/nfe           = the three summed: a forward and a backward count one evaluation each

counted by a forward pre-hook on each denoiser module (DenoiserEvaluations); the evaluation during training and the
FLOP count are not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import resource
import sys
from typing import Callable

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from ddpo_group.models.trainable import enable_checkpointing

GIB = 2**30

# Dense (no structured sparsity) tensor-core peak TFLOP/s of one GPU: (bf16/fp16 with fp32 accumulate, tf32, fp32), from
# the vendor datasheets (the sparse figures they headline are twice these). First match on torch.cuda.get_device_name.
#   H100 / H200 / GH200: NVIDIA H100, H200 and GH200 datasheets; B200: HGX B200 specifications (8 GPUs, divided by 8);
#   A100, A10, L4, L40, L40S: their datasheets; RTX 4090: Ada Lovelace architecture whitepaper (appendix A);
#   RTX 3090: Ampere GA102 whitepaper (appendix A).
PEAK_TFLOPS: list[tuple[str, tuple[float, float, float]]] = [
    (r"H100.*NVL", (835.0, 418.0, 60.0)),
    (r"H100.*PCIe", (756.0, 378.0, 51.0)),
    (r"H100|GH200", (989.0, 494.0, 67.0)),  # SXM (device name "H100 80GB HBM3")
    (r"H200.*NVL", (835.0, 418.0, 60.0)),
    (r"H200", (989.0, 494.0, 67.0)),
    (r"B200", (2250.0, 1125.0, 75.0)),
    (r"A100", (312.0, 156.0, 19.5)),
    (r"L40S", (362.0, 183.0, 91.6)),
    (r"L40\b", (181.0, 90.5, 90.5)),
    (r"\bL4\b", (121.0, 60.0, 30.3)),
    (r"\bA10\b", (125.0, 62.5, 31.2)),
    (r"RTX 4090(?! D)", (165.0, 83.0, 83.0)),
    (r"RTX 3090", (71.0, 35.6, 35.6)),
]


def peak_flops(device_name: str, mixed_precision: str, tf32: bool) -> float | None:
    """One device's dense peak FLOP/s for the compute dtype (None: a GPU not in PEAK_TFLOPS)."""
    for pattern, (half, tf32_peak, fp32) in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            if mixed_precision in ("bf16", "fp16"):
                return half * 1e12
            return (tf32_peak if tf32 else fp32) * 1e12
    return None


def device_peak_flops(device: torch.device, mixed_precision: str) -> tuple[float | None, str | None]:
    """(peak FLOP/s of ``device`` for the run's dtype or None, a note to print once when a GPU's peak is unknown)."""
    if device.type != "cuda":
        return None, None  # MFU is a GPU figure: nothing to say on the CPU
    name = torch.cuda.get_device_name(device)
    peak = peak_flops(name, mixed_precision, torch.backends.cuda.matmul.allow_tf32)
    if peak is None:
        return None, f"no perf/mfu_*: the peak FLOP/s of {name!r} is unknown (PEAK_TFLOPS in ddpo_group/run/reporting/throughput.py)"
    return peak, None


# the CPU's fused attention kernels, which torch's table lacks (it has the CUDA ones): counted alike, so a count made
# on the CPU equals the CUDA one
_aten = torch.ops.aten
CPU_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_flop_count(q, k, v),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_backward_flop_count(grad, q, k, v),
}


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of the matrix products, convolutions and attention that ``fn()`` runs, forward and backward."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        fn()
    return counter.get_total_flops()


@dataclasses.dataclass
class ModelFlops:
    train_per_pair: int  # F_pair (module docstring)
    sample_per_image: int  # F_image


def measure_model_flops(scorer, model, batch, params: list, step: int, sample_guidance: float, num_steps: int,
                        reference_forward: bool, autocast=contextlib.nullcontext) -> ModelFlops:
    """F_pair and F_image (module docstring) on sample 0 of ``batch`` at step ``step`` (every step costs the same).

    ``model`` is the unwrapped denoiser (a DDP wrapper would wait for a gradient reduction); ``params`` its trainable
    parameters, whose gradients are left as they were; ``autocast`` the training's (accelerator.autocast). No random
    number is drawn from the run's generators.
    """
    device = batch.log_probs.device
    rows = torch.zeros(1, dtype=torch.long, device=device)
    steps = torch.full((1,), step, dtype=torch.long, device=device)
    sampling = dataclasses.replace(scorer, guidance_scale=sample_guidance)

    def forward(s) -> None:
        with torch.no_grad(), autocast():
            s(model, batch, rows, steps)

    def forward_backward() -> None:
        saved = [p.grad for p in params]  # a partly accumulated gradient (gradient accumulation) must survive
        for p in params:
            p.grad = None
        try:
            with autocast():
                loss = scorer(model, batch, rows, steps).log_prob.float().sum()
            # backward(), not autograd.grad: FlopCounterMode's module hooks refuse autograd.grad
            loss.backward()
        finally:
            for p, grad in zip(params, saved):
                p.grad = grad

    # gradient checkpointing recomputes forwards in the backward: hardware FLOPs, not the model's. Counted without it
    # (one pair: its activations fit where the run's chunks needed it)
    checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
    if checkpointing:
        model.disable_gradient_checkpointing()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # a resumed run draws the same
            train = count_flops(forward_backward) + (count_flops(lambda: forward(scorer)) if reference_forward else 0)
    finally:
        if checkpointing:
            enable_checkpointing(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        sample = num_steps * count_flops(lambda: forward(sampling))
    return ModelFlops(train_per_pair=train, sample_per_image=sample)


def peak_rss_bytes() -> int:
    """This process's peak resident set size since it started (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class DenoiserEvaluations:
    """Counts the rows every watched denoiser forward receives, into the part of the epoch named by ``counting()``
    ("sampling" or "training"; none: not counted); ``take()`` returns the epoch's perf/nfe_* counts (module
    docstring) of this process and starts again from zero."""

    PARTS = ("sampling", "training")

    def __init__(self):
        self.part: str | None = None
        self.counts = dict.fromkeys(("sampling", "training", "backward"), 0)

    def watch(self, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(self._count, with_kwargs=True)

    @contextlib.contextmanager
    def counting(self, part: str):
        if part not in self.PARTS:
            raise ValueError(f"part={part!r} must be one of {self.PARTS}")
        previous, self.part = self.part, part
        try:
            yield
        finally:
            self.part = previous

    @torch.compiler.disable  # a compiled denoiser calls it eagerly
    def _count(self, module, args: tuple, kwargs: dict) -> None:
        if self.part is None:
            return
        inputs = list(args) + [kwargs[k] for k in ("hidden_states", "sample", "vision_tokens") if k in kwargs] + list(
            kwargs.values())
        latents = next((x for x in inputs if isinstance(x, (torch.Tensor, list, tuple))), None)
        # a tensor's first dimension, or per-sample latents (Z-Image's list; Cosmos 3's one sample a forward)
        rows = len(latents) if latents is not None else 0
        self.counts[self.part] += rows
        if self.part == "training" and torch.is_grad_enabled():
            self.counts["backward"] += rows

    def take(self) -> list[int]:
        """[sampling, training, backward] rows of this process since the last take."""
        out = [self.counts[k] for k in ("sampling", "training", "backward")]
        self.counts = dict.fromkeys(self.counts, 0)
        return out


class Throughput:
    """The perf/* metrics of every epoch (module docstring). ``start_epoch()`` when the epoch begins; ``metrics()``
    on every process after its training (it gathers once); ``measure(batch)`` -> ModelFlops is called once, after
    the first epoch, when the device's peak is known."""

    def __init__(self, accelerator, mixed_precision: str, measure: Callable[[dict], ModelFlops], print_fn=print):
        self.accelerator = accelerator
        self.measure = measure
        self.print = print_fn
        self.cuda = accelerator.device.type == "cuda"
        self.peak, note = device_peak_flops(accelerator.device, mixed_precision)
        if note and accelerator.is_main_process:
            self.print(note)
        self.flops: ModelFlops | None = None

    def start_epoch(self) -> None:
        if self.cuda:  # host-side allocator statistics: no device sync
            torch.cuda.reset_peak_memory_stats(self.accelerator.device)

    def metrics(self, images: int, local_pairs: int, sampling_s: float, training_s: float, batch,
                local_nfe: list[int], cuda_peak_floor: int = 0) -> dict:
        """perf/* of the epoch: ``images`` over every process, ``local_pairs`` and ``local_nfe`` (DenoiserEvaluations
        .take()) this process's, the phases' seconds; ``cuda_peak_floor``: a peak seen before something reset torch's
        counter this epoch (the auto-size probe)."""
        cuda_peak = max(torch.cuda.max_memory_allocated(self.accelerator.device), cuda_peak_floor) if self.cuda else 0
        local = torch.tensor([[float(local_pairs), float(peak_rss_bytes()), float(cuda_peak), *map(float, local_nfe)]],
                             dtype=torch.float64)
        every = self.accelerator.gather(local.to(self.accelerator.device)).cpu().view(-1, 6)  # one gather per epoch
        pairs = int(every[:, 0].sum())
        sampling, training, backward = (int(v) for v in every[:, 3:].sum(0))
        out = {"perf/images_sampled": int(images), "perf/pairs_trained": pairs,
               "perf/rss_gb": float(every[:, 1].max()) / GIB, "perf/nfe_sampling": sampling,
               "perf/nfe_training": training, "perf/nfe_backward": backward, "perf/nfe": sampling + training + backward}
        if sampling_s > 0:
            out["perf/images_per_s"] = images / sampling_s
        if training_s > 0:
            out["perf/pairs_per_s"] = pairs / training_s
        if self.cuda:
            out["perf/cuda_max_allocated_gb"] = float(every[:, 2].max()) / GIB
        if self.peak is None:
            return out
        if self.flops is None:  # once per run, after the epoch's memory was read
            try:
                self.flops = self.measure(batch)
            except Exception as error:  # a model the counter cannot trace must not stop training
                self.peak = None
                self.print(f"no perf/mfu_*: could not count the model's FLOPs ({type(error).__name__}: {error})")
                return out
            if self.accelerator.is_main_process:
                self.print(f"model FLOPs: {self.flops.train_per_pair / 1e12:.3g} TFLOP per trained pair, "
                           f"{self.flops.sample_per_image / 1e12:.3g} TFLOP per sampled image (denoiser only)")
        capacity = self.accelerator.num_processes * self.peak  # FLOP/s of every device together
        out["perf/tflop_per_pair"] = self.flops.train_per_pair / 1e12
        out["perf/tflop_per_image"] = self.flops.sample_per_image / 1e12
        if training_s > 0:
            out["perf/mfu_training"] = pairs * self.flops.train_per_pair / (training_s * capacity)
        if sampling_s > 0:
            out["perf/mfu_sampling"] = images * self.flops.sample_per_image / (sampling_s * capacity)
        return out
