"""The denoiser's speed options that are not memory formats or dtypes (config/base.py): ``compile_denoiser`` (torch.compile
of the whole denoiser or of its repeated blocks), ``cuda_graphs`` (the sampling steps' forwards replayed as CUDA graphs)
and ``attention_backend`` (the scaled-dot-product attention kernels torch may choose from). The trainer applies them
once the reference model is built (run/trainer.py); bench/speed_options.py measures each against the default, side by
side.
"""

from __future__ import annotations

import copy
import itertools
from contextlib import contextmanager

import torch
from accelerate.utils import recursively_apply
from torch.nn.attention import SDPBackend

from ddpo_group.errors import ConfigError

COMPILE_MODES = ("auto", False, True, "full", "regional")
# "auto": regional compilation on CUDA for a transformer denoiser of at least this many parameters, else off. Measured
# side by side (docs/studies/performance/, H200, SD3.5-M shape, bf16, LoRA): training 1.59x, sampling 1.70x, 69 s of
# compilation repaid within 2 epochs of 64 images x 20 steps; a tiny model never repays it, nor does the CPU
AUTO_MIN_PARAMETERS = 10**9
# denoisers "auto" leaves uncompiled: SD-1.5's UNet measured 0.93x training (one compiled forward serves its attention
# blocks at four sizes, with and without gradients: dynamo's recompile limit of 8 is reached and the rest runs eager)
AUTO_SKIPS = ("UNet2DConditionModel",)
# regional compilation: dynamo compiles a block's forward again for each new variant it meets (parameter shapes, grad
# mode on / off, the LoRA adapter on / off for the KL reference, a new token count before it turns the count dynamic),
# and past its recompile limit (8 by default, per code object: all blocks of a class share one) runs the rest eager, as
# SD-1.5's UNet did (four sizes of one block class, with and without gradients). The limit is raised to this many
# compilations per distinct parameter-shape signature among the blocks
RECOMPILES_PER_SHAPE = 8
# denoiser classes whose diffusers class declares no ``_repeated_blocks`` (diffusers 0.42.1: SD3's transformer): the
# classes of their repeated blocks, handed to ModelMixin.compile_repeated_blocks as if declared
REPEATED_BLOCKS = {"SD3Transformer2DModel": ("JointTransformerBlock",)}

# torch's SDPA kernels by name; "auto" lets torch choose among all of them but cuDNN's, which is used only when named:
# torch 2.11 (CUDA 13) picked it for FLUX.1's heads of 128 on an H200 and its backward failed there (mha_graph.execute,
# then an illegal memory access: docs/studies/performance/), and at SD3.5-M shape it trained slower than torch's choice.
# A named kernel keeps the math one for the calls it cannot run (torch prefers the named one): flash takes heads of at
# most 256 channels, and the VAE's attention is one head of 512 (an H100 run with flash alone stopped there)
ATTENTION_BACKENDS = {
    "auto": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
    "flash": (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH),
    "cudnn": (SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
    "math": (SDPBackend.MATH,),
}
CUDA_ONLY_BACKENDS = ("cudnn", "efficient")  # the CPU has a flash kernel and the math one only
HALF_PRECISION_BACKENDS = ("flash", "cudnn")  # on CUDA: fp16 / bf16 inputs only


def compile_mode(value) -> str | None:
    """``compile_denoiser`` as a mode: None (off), "auto", "full" (True means the same) or "regional"."""
    if value is False or value == "" or value is None:
        return None
    if value == "auto":
        return "auto"
    if value is True or value == "full":
        return "full"
    if value == "regional":
        return "regional"
    raise ConfigError(f"compile_denoiser={value!r} must be one of {COMPILE_MODES} (True: 'full')")


def repeated_blocks(model: torch.nn.Module) -> tuple[str, ...]:
    """Class names of ``model``'s repeated blocks: the diffusers class's ``_repeated_blocks``, else REPEATED_BLOCKS."""
    return tuple(getattr(model, "_repeated_blocks", None) or REPEATED_BLOCKS.get(type(model).__name__, ()))


def auto_compile_mode(model: torch.nn.Module, device, sharded: bool = False, deterministic: bool = False) -> str | None:
    """What ``compile_denoiser="auto"`` means for ``model`` on ``device``: "regional" on CUDA for a denoiser with
    repeated blocks, of at least AUTO_MIN_PARAMETERS and not in AUTO_SKIPS, unless FSDP will shard it (``sharded``)
    or the run is ``deterministic`` (neither measured together with compilation); None (off) otherwise."""
    big = sum(p.numel() for p in model.parameters()) >= AUTO_MIN_PARAMETERS
    measured_slower = type(model).__name__ in AUTO_SKIPS
    on_cuda = torch.device(device).type == "cuda"
    unmeasured = sharded or deterministic
    return "regional" if on_cuda and big and not measured_slower and not unmeasured and repeated_blocks(model) else None


def compile_denoiser(model: torch.nn.Module, value, device="cpu", sharded: bool = False,
                     deterministic: bool = False) -> str | None:
    """Compile ``model`` in place (Module.compile: names, hooks, state dict and LoRA adapters unchanged) as
    ``compile_denoiser`` says: the whole forward ("full" / True), every repeated block ("regional": diffusers'
    ModelMixin.compile_repeated_blocks; the same compiled code serves every block of a class, so compilation takes
    far less time) or, with "auto", what auto_compile_mode says. Returns the mode applied (None: off)."""
    mode = compile_mode(value)
    if mode == "auto":
        mode = auto_compile_mode(model, device, sharded, deterministic)
    if mode == "full":
        model.compile()
    elif mode == "regional":
        names = repeated_blocks(model)
        if not names:
            raise ConfigError(f"compile_denoiser='regional': {type(model).__name__} declares no repeated blocks "
                              f"(diffusers' _repeated_blocks; REPEATED_BLOCKS in ddpo_group/models/speed_options.py); "
                              f"use compile_denoiser='full'")
        model._repeated_blocks = list(names)  # the table's, where diffusers declares none for the class
        raise_recompile_limit(model, names)
        model.compile_repeated_blocks()
    return mode


def raise_recompile_limit(model: torch.nn.Module, names: tuple[str, ...]) -> int:
    """Raise dynamo's recompile limit (process-wide, never lowered) to RECOMPILES_PER_SHAPE per distinct parameter-shape
    signature among ``model``'s blocks of the classes ``names``; returns the limit now in force."""
    import torch._dynamo.config as dynamo

    signatures = {(type(block).__name__, tuple(tuple(p.shape) for p in block.parameters()))
                  for block in model.modules() if type(block).__name__ in names}
    field = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # its name before torch 2.6
    setattr(dynamo, field, max(getattr(dynamo, field), RECOMPILES_PER_SHAPE * len(signatures)))
    return getattr(dynamo, field)


@contextmanager
def eager(model: torch.nn.Module):
    """Inside, the modules of ``model`` that Module.compile compiled (compile_denoiser: the whole denoiser or its
    repeated blocks) run their plain forward."""
    compiled = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
    for m, _ in compiled:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, impl in compiled:
            m._compiled_call_impl = impl


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s modules sharing its parameters and buffers: the same weights (an optimizer step or a
    checkpoint load changes both, in place) under modules of its own (its own hooks and adapter switches; none
    compiled: a module's copy drops its compiled call, Module.__getstate__)."""
    return copy.deepcopy(model, memo={id(t): t for t in itertools.chain(model.parameters(), model.buffers())})


def check_cuda_graphs(cuda_graphs, device, sharded: bool = False) -> None:
    """Refuse ``cuda_graphs=True`` where it cannot run: it needs CUDA, without FSDP (a sharded forward gathers its
    weights on every call)."""
    device_type = torch.device(device).type
    if cuda_graphs and device_type != "cuda":
        raise ConfigError(f"cuda_graphs=True needs a CUDA device, and this run is on the {device_type}: set "
                          f"cuda_graphs=False")
    if cuda_graphs and sharded:
        raise ConfigError("cuda_graphs=True cannot run under FSDP (each forward gathers the sharded weights): set "
                          "cuda_graphs=False or use a DDP launch")


def sampling_denoiser(model: torch.nn.Module, cuda_graphs: bool) -> torch.nn.Module:
    """The denoiser the sampling steps call: ``model`` itself, or with ``cuda_graphs`` a shared copy of it (without
    what ``compile_denoiser`` did to ``model``), in eval mode, whose forward is compiled with torch.compile's
    "reduce-overhead" mode: on CUDA each sampling batch shape's forward is recorded once as a CUDA graph and replayed,
    its kernels launched without the Python and launch overhead of each (on the CPU: the same compiled code, no
    graphs). A graph's outputs live in its memory pool and the next replay overwrites them, so the copy returns clones
    (a forward hook, outside the compiled forward): a family that keeps the conditional output while it computes the
    unconditional one (Qwen-Image, Wan) reads what it kept. Training keeps ``model`` (the copy never computes
    gradients); the copy stays on the policy's adapter whatever the reference or old model switch on ``model``.
    check_cuda_graphs says where it can run."""
    if not cuda_graphs:
        return model
    copy_ = shared_copy(model).eval()
    copy_.forward = torch.compile(copy_.forward, mode="reduce-overhead")  # accelerate's mixed-precision forward too
    copy_.register_forward_hook(lambda module, args, output: recursively_apply(torch.clone, output))
    return copy_


def attention_backends(name: str, device, mixed_precision: str | None = None) -> tuple[SDPBackend, ...]:
    """The SDPA kernels ``attention_backend`` allows on ``device``; a name torch lacks there is refused, and so is a
    half-precision kernel on CUDA without mixed precision (``mixed_precision`` given): every call would fall back to
    the math kernel, slower than "auto"."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend={name!r} must be one of {tuple(ATTENTION_BACKENDS)}")
    device_type = torch.device(device).type
    if name in CUDA_ONLY_BACKENDS and device_type != "cuda":
        raise ConfigError(f"attention_backend={name!r} is a CUDA kernel; on the {device_type} use 'auto', 'flash' or "
                          f"'math'")
    if name in HALF_PRECISION_BACKENDS and device_type == "cuda" and mixed_precision == "no":
        raise ConfigError(f"attention_backend={name!r} runs fp16 / bf16 only on CUDA, and mixed_precision='no': "
                          f"set mixed_precision to 'bf16' or 'fp16', or use attention_backend 'auto' or 'efficient'")
    return ATTENTION_BACKENDS[name]


def set_attention_backend(name: str, device, mixed_precision: str | None = None) -> None:
    """Allow only ``attention_backend``'s SDPA kernels, for the whole process (torch.backends.cuda.enable_*_sdp: the
    switches torch.nn.attention.sdpa_kernel sets; the CPU reads the flash and math ones too); a call the named kernel
    cannot run (flash and cuDNN need fp16 / bf16 on CUDA and heads of at most 256) runs the math kernel."""
    allowed = attention_backends(name, device, mixed_precision)
    torch.backends.cuda.enable_flash_sdp(SDPBackend.FLASH_ATTENTION in allowed)
    torch.backends.cuda.enable_mem_efficient_sdp(SDPBackend.EFFICIENT_ATTENTION in allowed)
    torch.backends.cuda.enable_cudnn_sdp(SDPBackend.CUDNN_ATTENTION in allowed)
    torch.backends.cuda.enable_math_sdp(SDPBackend.MATH in allowed)
