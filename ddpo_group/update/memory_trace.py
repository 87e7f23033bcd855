"""A training step's peak memory on one card, traced on the CPU with fake tensors: no weights, no GPU, no memory.

The pipeline is built on the meta device (models/full_size.py's shapes), its weights made fake tensors of the run's
dtypes on the CPU (``fake_pipeline``), and the run's own code runs on them as a GPU run would: the family (its
sampler for one rollout record, its step means recorded as the collector records them), the trainable parameters
(LoRA or the whole denoiser, models/trainable.py), the KL term's reference, a matching objective's old model, the EMA,
AdamW (its foreach path, CUDA's default), and the update's forward + backward of ``pairs`` (sample, step) pairs
(Updater.accumulate_gradients, what update/memory_fit.py's probe runs) under the run's autocast, then the optimizer
step. Fake tensors carry shapes, dtypes and sizes but no data, so torch's memory tracker (MemTracker, a dispatch
mode) sees every allocation and free of the step; what only reads data (a tokenizer's mask, a prompt's length) runs
on real CPU tensors, which the tracker counts too (``fake_reads``: a number read from a fake tensor reads 1; a real
mask selecting from a fake tensor selects its True entries; a large tensor made from real ones alone is made fake).

    trace_step(k): forward + backward of k pairs and the optimizer step, untraced (Adam's moments appear); then
                   forward + backward of k pairs traced: ``peak`` (the steady state of every later train batch),
                   split into the tracker's kinds (parameters of every module on the card, text encoders off it
                   with ``pretrained.text_encoder_device="cpu"``; buffers; gradients; optimizer state; activations;
                   temporaries; other: the rollout record, the EMA); then the optimizer step traced:
                   ``optimizer_peak`` (AdamW's float32 temporaries beside the gradients)

CPU autocast casts the same matrix products and convolutions to the low-precision dtype as CUDA autocast, but leaves
the operations CUDA autocast runs in float32 (normalizations, softmax, exp, sums) in their inputs' dtype: the trace
casts those up as CUDA does (``CudaAutocast``), above autograd, so the float32 copies a GPU saves for the backward
are counted. Scaled-dot-product attention runs the CPU flash kernel, which stores the output and its log-sum-exp as
CUDA's flash and memory-efficient kernels do (memory linear in tokens).

What a trace leaves out: the CUDA context and cuBLAS / cuDNN workspaces (outside torch's count, as they are outside
``torch.cuda.max_memory_allocated``), the caching allocator's fragmentation (the reason update/memory_fit.py keeps 15%
of the card), compiled kernels' buffers, the reward models, the critic (GROUP_PPO's and PPO's value network, trained
after the policy's step), and the prompts' lengths: each row is a short prompt, padded as the family pads (a family
that crops its text to the longest prompt, as Qwen-Image does, takes more with long prompts).
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

GIB = 2**30
KINDS = {"PARAM": "parameters", "BUFFER": "buffers", "GRAD": "gradients", "OPT": "optimizer state",
         "ACT": "activations", "TEMP": "temporaries", "OTH": "other"}


BIG = 2**28  # bytes: a tensor made from real tensors alone, larger than this, is made fake (``FakeReads``)


class FakeReads(TorchDispatchMode):
    """How a traced step reads what fake tensors cannot hold. A fake tensor read as a Python number (a metric's
    ``float()``, an ``.item()``) reads 1: the numbers a step reads steer its metrics, not its memory. An operation
    of real tensors alone (a mask's padding, a factory) whose result would pass ``BIG`` bytes gives a fake result of
    its shape (the memory is counted, not taken from this machine). With ``select_all``, a selection by a fake mask
    (``nonzero``, under a boolean index) selects every element: the most memory it can take, and a size the tracker
    can count."""

    def __init__(self, mode: FakeTensorMode, select_all: bool = False):
        super().__init__()
        self.mode, self.select_all = mode, select_all

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [value for value in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(value, torch.Tensor)]
        if any(isinstance(value, FakeTensor) for value in tensors):
            return self.fake_operation(func, args, kwargs)
        if func is not torch.ops.aten._local_scalar_dense.default:
            try:
                with self.mode:
                    fake = func(*args, **kwargs)
            except Exception:  # noqa: BLE001  (an operation whose result reads the data: it runs on the data)
                fake = None
            made = [value for value in torch.utils._pytree.tree_leaves(fake) if isinstance(value, torch.Tensor)]
            try:
                big = bool(made) and bool(sum(value.numel() * value.element_size() for value in made) > BIG)
            except Exception:  # noqa: BLE001  (a size only the data tells: it runs on the data)
                big = False
            if big:
                return fake
        return func(*args, **kwargs)

    def fake_operation(self, func, args, kwargs):
        first = args[0] if args else None
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if first.dtype == torch.bool else (1.0 if first.is_floating_point() else 1)
        if func is torch.ops.aten.index.Tensor and any(real_mask(index) for index in args[1]):
            # a real mask (``RealMasks``' case met below autograd: an assignment's backward): its real indices
            indices = []
            for index in args[1]:
                indices.extend(index.nonzero(as_tuple=True) if real_mask(index) else (index,))
            return func(first, indices)
        if self.select_all and isinstance(first, FakeTensor):
            if func is torch.ops.aten.nonzero.default:
                with first.fake_mode:
                    return torch.empty(first.numel(), first.dim(), dtype=torch.long, device=first.device)
            if func is torch.ops.aten.index.Tensor and len(args[1]) == 1 and args[1][0] is not None \
                    and args[1][0].dtype == torch.bool:  # tensor[mask]
                with first.fake_mode:
                    return first.flatten(0, args[1][0].dim() - 1).clone()
        return func(*args, **kwargs)


class RealMasks(TorchFunctionMode):
    """A fake tensor indexed by a real boolean mask (a prompt's padding mask): the mask becomes the real indices of
    its True entries, so the selection has the size a GPU run gives it, not a size only the data could tell."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and isinstance(args[0], FakeTensor):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(real_mask(part) for part in index):
                parts = []
                for part in index:
                    parts.extend(part.nonzero(as_tuple=True) if real_mask(part) else (part,))
                args = (args[0], tuple(parts))
        return func(*args, **kwargs)


def real_mask(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and value.dtype == torch.bool


@contextmanager
def fake_reads(mode: FakeTensorMode, select_all: bool = False):
    """``FakeReads`` and ``RealMasks`` together: what a traced family's code runs under."""
    with RealMasks(), FakeReads(mode, select_all):
        yield


# the operations CUDA autocast runs in float32 (torch.amp's documented list); CPU autocast casts the same matrix
# products and convolutions to the low-precision dtype but leaves these in their inputs' dtype
CUDA_FLOAT32_OPS = ("__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin",
                    "binary_cross_entropy_with_logits", "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity",
                    "cross_entropy", "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1", "group_norm",
                    "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax", "log10", "log1p",
                    "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
                    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt",
                    "sinh", "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm",
                    "tan", "triplet_margin_loss")


# the operations CUDA autocast runs in the widest of their inputs' floating dtypes (torch.amp's documented list),
# which CPU autocast runs as they come (a float32 tensor and a bfloat16 one: an error)
CUDA_PROMOTE_OPS = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
                    "scatter_add", "tensordot")


def torch_functions(names) -> set:
    """The torch functions, tensor methods and torch.nn.functional functions of ``names``."""
    functions = set()
    for name in names:
        for owner in (torch, torch.Tensor, torch.nn.functional):
            if hasattr(owner, name):
                functions.add(getattr(owner, name))
    return functions


class CudaAutocast(TorchFunctionMode):
    """The operations CUDA autocast runs in float32 (``CUDA_FLOAT32_OPS``) get their low-precision inputs cast to
    float32 first, and those it runs in the widest input dtype (``CUDA_PROMOTE_OPS``, Cosmos 3's scatter_add of a
    float32 timestep embedding into bfloat16 tokens) to that dtype, above autograd as CUDA autocast casts them: the
    step saves the float32 copies for its backward as it does on a GPU (a GroupNorm's input, a softmax's output).
    Entered around what runs under the run's mixed precision (a float32 run has no low-precision input), and around
    the backward's recomputation under gradient checkpointing (``recomputed_as_traced``)."""

    def __init__(self, enabled: bool = True):
        super().__init__()
        self.functions, self.enabled = torch_functions(CUDA_FLOAT32_OPS), enabled
        self.promoting = torch_functions(CUDA_PROMOTE_OPS)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.enabled and (func in self.functions or func in self.promoting):
            if func in self.functions:
                widest = torch.float32
            else:  # the widest floating dtype among the inputs
                floats = [value.dtype for value in (*args, *kwargs.values())
                          if isinstance(value, torch.Tensor) and value.is_floating_point()]
                widest = max(floats, key=lambda dtype: torch.finfo(dtype).bits, default=torch.float32)

            def up(value):
                if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16) \
                        and value.dtype != widest:
                    return value.to(widest)
                return value

            args = tuple(up(value) for value in args)
            kwargs = {key: up(value) for key, value in kwargs.items()}
        return func(*args, **kwargs)


def recomputed_as_traced(module, *args, **kwargs):
    """models/trainable.py's ``checkpointed`` with the trace's function modes (``RealMasks``, ``CudaAutocast``)
    entered again around the backward's recomputation. The backward is a call those modes handle, and a mode steps
    aside while it handles one: without this, the recomputation runs outside them and saves bfloat16 values where
    the forward saved float32 ones (the checkpoint then refuses them, as a GPU's autocast would not)."""
    @contextmanager
    def recompute():
        with RealMasks(), CudaAutocast():
            yield

    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False,
                                             context_fn=lambda: (nullcontext(), recompute()), **kwargs)


def fake_mode() -> FakeTensorMode:
    """A fake mode that takes real CPU tensors as inputs (the tokenizer's ids, the sampler's noise) and lets an output
    whose size reads data (a boolean mask's selection) have a symbolic size."""
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(allow_dynamic_output_shape_ops=True))


def fake_module(module: torch.nn.Module, mode: FakeTensorMode, dtype: torch.dtype, made: dict | None = None) -> None:
    """Replace a meta-device module's parameters and buffers by fake CPU tensors of their shapes, floating ones in
    ``dtype`` (in place; requires_grad kept). A tensor met twice (tied weights: an embedding and its head) becomes one
    fake tensor; ``made`` ({id: fake}) carries that across the modules of one pipeline."""
    converter = mode.fake_tensor_converter
    device = torch.device("cpu")
    made = {} if made is None else made

    def fake(tensor, parameter: bool):  # from its shape: a meta tensor, or a fake one made before in another dtype
        if id(tensor) not in made:
            meta = torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype,
                               device="meta")
            value = converter.from_meta_and_device(mode, meta, device)
            made[id(tensor)] = torch.nn.Parameter(value, requires_grad=tensor.requires_grad) if parameter else value
        return made[id(tensor)]

    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = fake(param, parameter=True)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = fake(buffer, parameter=False)


def fake_real_parameters(module: torch.nn.Module, mode: FakeTensorMode) -> dict:
    """Replace ``module``'s real parameters (LoRA's adapters, made beside fake weights) by fake tensors of the same
    shapes and dtypes (in place; requires_grad kept); returns {id(real): fake}."""
    converter, made = mode.fake_tensor_converter, {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and not isinstance(param, FakeTensor):
                if id(param) not in made:
                    fake = converter.from_real_tensor(mode, param.detach())
                    made[id(param)] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
                sub._parameters[name] = made[id(param)]
    return made


def fake_pipeline(build, mode: FakeTensorMode, dtype: torch.dtype):
    """``build()``'s pipeline (models/full_size.py) on the meta device, every module's weights (and every tensor the
    pipeline holds itself) made fake in ``dtype``, its scheduler made again on the CPU (its tables are read as
    numbers)."""
    with torch.device("meta"):
        pipe = build()
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)  # its tables real, on the CPU
    made = {}

    def fake_attributes(holder) -> None:  # tensors held as plain attributes (latent statistics, a RoPE's tables)
        for name, value in list(vars(holder).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(holder, name, fake_of(value))
            elif isinstance(value, list) and value and all(isinstance(v, torch.Tensor) and v.is_meta for v in value):
                setattr(holder, name, [fake_of(v) for v in value])

    def fake_of(value):
        meta = torch.empty(value.shape, dtype=dtype if value.is_floating_point() else value.dtype, device="meta")
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device("cpu"))

    fake_attributes(pipe)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            fake_module(module, mode, dtype, made)
            for sub in module.modules():
                fake_attributes(sub)
    return pipe


@dataclass
class Trace:
    """One traced training step: the forward + backward's ``peak`` bytes on the card and its kinds (``KINDS``' names:
    bytes), the pairs per forward, the trainable parameters and the optimizer step's peak."""

    pairs: int
    peak: int
    kinds: dict = field(default_factory=dict)
    trainable: int = 0  # parameters
    optimizer_peak: int = 0
    tensors: int = 0  # trainable tensors (AdamW keeps a step count of each)

    def gib(self, kind: str | None = None) -> float:
        """The peak, or one kind's bytes at it, in GiB."""
        return (self.peak if kind is None else self.kinds[kind]) / GIB


def peak_snapshot(tracker) -> tuple[int, dict]:
    """(total, {kind: bytes}) of the tracker's peak on the CPU device (where every fake tensor lives)."""
    snapshot = tracker.get_tracker_snapshot("peak")
    per_kind = snapshot[torch.device("cpu")]
    kinds = {KINDS[str(kind).split(".")[-1]]: int(value) for kind, value in per_kind.items() if kind != "Total"}
    return int(per_kind["Total"]), kinds


class NoHook:
    """A hook handle of nothing: what the tracker is given for a frozen weight, which has no gradient to hook."""

    def remove(self):
        pass


def step_tracker():
    """torch's memory tracker without its per-module statistics (which refuse a module called twice in one step, as
    the KL term's reference forward calls the policy's denoiser with its adapter off) and without its module
    hierarchy (ModTracker). That hierarchy hooks each module's inputs with a multi-grad hook that keeps their gradients
    until every input's has come: under full fine-tuning every block's input gradient waited for the timestep
    embedding's, which only comes at the backward's end (SD3.5-M with checkpointing: 24 block-sized gradients, 10.6 GiB
    at 79 pairs, that a GPU's step never holds). The backward is known from the autograd engine, not from hooks."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker

    class NoModuleHooks(ModTracker):
        def __enter__(self):
            return self

        def __exit__(self, *args):
            pass

    class StepTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._mod_tracker = NoModuleHooks()

        def _pre_fw_hook(self, *args):
            pass

        def _post_fw_hook(self, *args):
            pass

        def _pre_bw_hook(self, *args):
            pass

        def _post_bw_hook(self, *args):
            pass

    return StepTracker()


def trace_step(run: "TracedRun", pairs: int) -> Trace:
    """The step of the module docstring for ``pairs`` pairs of the run's record, the card holding ``run.on_card``'s
    weights: on the run's first trace a forward + backward and optimizer step untraced (Adam's moments appear), then
    the forward + backward traced (``peak``) and the optimizer step traced (``optimizer_peak``: AdamW's temporaries
    beside the gradients)."""
    from ddpo_group.update.memory_fit import drop_gradients, probe_batch

    updater, batch, trainable, on_card = run.updater, run.batch, run.trainable, run.on_card

    probe, rows, mask = probe_batch(batch, pairs, trainable)
    drop_gradients(updater.params)
    updater.model.train()
    record = [value for value in vars(batch).values() if isinstance(value, torch.Tensor)]
    record += [value for part in (batch.cond, batch.times) for value in part.values()]
    record += updater.ema.shadow if updater.ema is not None else []  # the EMA's float32 copy of the trained weights
    with fake_reads(run.mode, select_all=True), torch.enable_grad():
        if not all(updater.optimizer.state.get(param) for param in updater.params):  # the run's first trace
            with CudaAutocast():
                updater.accumulate_gradients(probe, rows, mask, pairs_per_forward=pairs)
            updater.optimizer.step()
            updater.optimizer.zero_grad(set_to_none=True)
        tracker = tracked(on_card, updater.optimizer, record)
        with tracker, CudaAutocast():
            updater.accumulate_gradients(probe, rows, mask, pairs_per_forward=pairs)
        peak, kinds = peak_snapshot(tracker)
        tracker = tracked(on_card, updater.optimizer, record + [p.grad for p in updater.params])
        with tracker:
            updater.optimizer.step()
        optimizer_peak, _ = peak_snapshot(tracker)
        updater.optimizer.zero_grad(set_to_none=True)
    return Trace(pairs, peak, kinds, sum(p.numel() for p in updater.params), optimizer_peak, len(updater.params))


def tracked(on_card: list, optimizer, tensors: list):
    """A step tracker (``step_tracker``) counting the card's modules, the optimizer's state and ``tensors``."""
    tracker = step_tracker()
    for module in on_card:
        for param in module.parameters():
            if not param.requires_grad:  # torch's tracker hooks the gradient of every parameter it sees
                tracker._param_to_grad_hook_handles[param] = (NoHook(), NoHook())
        tracker._track_module_params_and_buffers(module, install_grad_hooks=True)
    tracker.track_external(optimizer, *[tensor for tensor in tensors if tensor is not None])
    return tracker


def traced_precision(config) -> str:
    """The mixed precision a trace runs: the run's, fp16 as bf16 (CPU autocast's; the same two bytes a value)."""
    return "bf16" if config.mixed_precision == "fp16" else config.mixed_precision


@dataclass
class TracedRun:
    """What ``traced_run`` builds on fake weights, as the trainer builds it: the family, its updater (with its
    optimizer, KL term and old model), one process's rollout record of an epoch and the modules on the card."""

    family: object
    updater: object
    batch: object
    trainable: torch.Tensor
    on_card: list
    notes: list
    mode: FakeTensorMode  # the fake tensors' (a fresh one for a real pipeline)


def traced_run(config, pipe, mode: FakeTensorMode | None = None) -> TracedRun:
    """The run ``config`` describes on ``pipe`` (``fake_pipeline``'s, made in ``mode``; or a real one, which the
    tests trace to compare) as the trainer builds it (module docstring): the trainable
    parameters and frozen modules placed as models/trainable.py places them, the KL term's reference and a matching
    objective's old model as the trainer builds them, and the rollout record of one process's epoch
    (``sample.batch_size`` x ``sample.num_batches_per_epoch`` samples of ``sample.num_steps`` steps): one batch of
    ``sample.batch_size`` prompts sampled by the family's sampler (sampling/trajectories.py), the others copies of it,
    with the decoded images' shape."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddpo_group.algorithms import get_objective
    from ddpo_group.models.families import get_family
    from ddpo_group.models.trainable import TEXT_ENCODERS, lora_config, make_optimizer, make_trainable
    from ddpo_group.reference.regularizer import KLRegularizer
    from ddpo_group.sampling.batch import RolloutBatch
    from ddpo_group.sampling.trajectories import SamplingOptions, TransitionScorer, decode_latents, sample_trajectories
    from ddpo_group.update import updater_class
    from ddpo_group.update.ema import EMAWeights
    from ddpo_group.update.old_model import OldModel
    from ddpo_group.update.updater import UpdateOptions

    notes = []
    faked, mode = mode is not None, mode or fake_mode()
    precision = traced_precision(config)
    if precision != config.mixed_precision:
        notes.append("fp16 traced as bf16 (the same two bytes a value)")
        config = config.copy_and_resolve_references()
        config.mixed_precision = precision
    family = get_family(config.pretrained.family)(pipe, config)
    if faked and not config.use_lora:  # full fine-tuning trains float32 weights (models/trainable.py)
        fake_module(family.model, mode, torch.float32)
    # outside the fake mode: LoRA's adapters are real (small) CPU tensors, which peft places beside fake weights
    params = make_trainable(family, config, "cpu")
    if config.train.gradient_checkpointing:
        family.model.enable_gradient_checkpointing(recomputed_as_traced)
    lora = lora_config(config, family.lora_target_modules) if config.use_lora else None
    kl = KLRegularizer.from_config(config, family.model, lora)
    objective = get_objective(config.algorithm.objective)
    old = (OldModel.from_config(config, family.model, lora)
           if objective.uses_old_model(config.algorithm.objective_kwargs) else None)
    if faked:  # LoRA's adapters (the policy's, the reference's, the old model's) made fake: a real tensor among
        made = fake_real_parameters(family.model, mode)  # fake ones is converted again at every operation
        params = [made.get(id(param), param) for param in params]
    optimizer = make_optimizer(config, params)
    for group in optimizer.param_groups:  # CUDA's default AdamW: the foreach one (a float32 temporary a weight)
        group["foreach"] = True
    ema = EMAWeights.from_config(config, params)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    scorer = TransitionScorer.from_config(config, family)
    options = UpdateOptions(config, accelerator, family.model, optimizer, params, scorer, kl, ema=ema, old=old)
    updater = updater_class(objective.kind)(options)
    with accelerator.autocast():  # the sampler runs under it as the trainer's does
        with fake_reads(mode), CudaAutocast():
            batch = rollout_record(config, family, objective, RolloutBatch, SamplingOptions, sample_trajectories,
                                   decode_latents)
    on_card = [module for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)
               and not (name in TEXT_ENCODERS and config.pretrained.text_encoder_device == "cpu")]
    for reference in (kl.reference if kl is not None else None, old.weights if old is not None else None):
        if reference is not None and reference.mode == "copy":  # full fine-tuning's frozen copies of the denoiser
            on_card.append(reference.copy)
    return TracedRun(family, updater, batch, family.stochastic_steps(config.sample), on_card, notes, mode)


def rollout_record(config, family, objective, RolloutBatch, SamplingOptions, sample_trajectories, decode_latents):
    """One process's rollout record of an epoch (``traced_run``), advantages zero."""
    from ddpo_group.models.source_images import SOURCE_IMAGE_KEY

    sample = config.sample
    size = int(sample.batch_size)
    prompts = [f"a photograph of prompt {i}" for i in range(size)]
    metadata = [{}] * size
    if family.capabilities.image_conditioning:  # an editing family's source image, at the sample's size
        from PIL import Image

        path = Path(tempfile.mkdtemp()) / "source.png"
        height, width = family.height_width
        Image.new("RGB", (width, height), (128, 96, 64)).save(path)
        metadata = [{SOURCE_IMAGE_KEY: str(path)}] * size
    cond = family.condition(prompts, metadata)
    rows_negative = family.negative_rows(metadata)  # each row's own, as the collector records (an editing family's)
    negative = rows_negative if rows_negative is not None else family.negative_condition()
    # the rollout policy's step means, as rollout/collector.py records them (a latent a step)
    options = SamplingOptions.rollouts(sample, family, decode=False, record_means=not objective.is_matching)
    traj = sample_trajectories(family, family.model, cond, negative, options, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        images = decode_latents(family, traj.latents[:1, -1])
    copies = int(sample.num_batches_per_epoch)

    def epoch(tensor):  # the epoch's num_batches_per_epoch batches
        return tensor.repeat(copies, *([1] * (tensor.dim() - 1)))

    rows = size * copies
    return RolloutBatch(
        prompts=prompts * copies, metadata=metadata * copies, cond={k: epoch(v) for k, v in cond.items()},
        negative={k: epoch(v) for k, v in rows_negative.items()} if rows_negative is not None else None,
        latents=epoch(traj.latents[:, :-1]), next_latents=epoch(traj.latents[:, 1:]), log_probs=epoch(traj.log_probs),
        times={k: epoch(v) for k, v in traj.times.items()},
        images=images.expand(rows, *images.shape[1:]).clone(), rewards=torch.zeros(rows, dtype=torch.float64),
        reward_info={}, advantages=torch.zeros(rows, traj.log_probs.shape[1]),
        step_means=epoch(traj.means) if traj.means is not None else None)
