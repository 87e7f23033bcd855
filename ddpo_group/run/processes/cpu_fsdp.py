"""FSDP2 on the CPU: the processes of an FSDP launch that run on the CPU (gloo) shard the model as on GPUs.

``accelerate launch`` with an FSDP config file passes the FSDP fields to its processes (``ACCELERATE_USE_FSDP`` and the
``FSDP_*`` variables), but accelerate's state maps any CPU run to MULTI_CPU and drops the FSDP plugin: the model would
be replicated by DDP instead, silently. torch's ``fully_shard`` itself runs on a CPU mesh over gloo, given to it (its
default mesh is on the machine's GPU when it has one, whatever the process group), and accelerate's FSDP2 path
(``prepare`` -> ``fully_shard`` per block, gradient clipping, ``save_state`` / ``load_state`` of the sharded model and
optimizer through torch.distributed.checkpoint) calls nothing GPU-only. ``enable_fsdp_on_cpu`` puts the launcher's
FSDP plugin and a CPU mesh into the state, so ``prepare`` shards on the CPU too.

What stays GPU-only: FSDP1 (``fsdp_version: 1``; its CPU support is not what the shipped files use) and the FSDP
fields that move weights between the GPU and the CPU (``fsdp_offload_params``, ``fsdp_cpu_ram_efficient_loading``):
a CPU run refuses them, naming the field.
"""

from __future__ import annotations

import os

from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import CPUOffloadPolicy

from ddpo_group.errors import ConfigError


def fsdp_requested() -> bool:
    """True when the launcher asked for FSDP (an accelerate config file with ``distributed_type: FSDP``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def launch_shards(num_processes: int, on_gpu: bool) -> bool:
    """Whether this launch's weights and optimizer will be sharded by FSDP: an FSDP launch, unless it is one process
    on the CPU (accelerate then starts no process group and keeps the model whole)."""
    return fsdp_requested() and (num_processes > 1 or on_gpu)


def enable_fsdp_on_cpu(accelerator, mixed_precision: str) -> bool:
    """When ``accelerator`` runs several processes on the CPU and the launcher asked for FSDP, make its state FSDP
    with the launcher's plugin (module docstring); returns whether it did. Call before ``accelerator.prepare``."""
    if accelerator.distributed_type != DistributedType.MULTI_CPU or not fsdp_requested():
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables, as accelerate builds it
    if plugin.fsdp_version != 2:
        raise ConfigError(f"fsdp_version={plugin.fsdp_version} on the CPU: only FSDP2 (fsdp_version: 2, torch's "
                          "fully_shard) shards on a CPU mesh; use it, or run FSDP1 on GPUs")
    for field, value in (("fsdp_offload_params", isinstance(plugin.cpu_offload, CPUOffloadPolicy)),
                         ("fsdp_cpu_ram_efficient_loading", bool(plugin.cpu_ram_efficient_loading))):
        if value:
            raise ConfigError(f"{field}=true moves weights between the GPU and the CPU; a CPU run has no GPU: "
                              f"set {field}: false (or --{field} false on the accelerate launch command line)")
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    # fully_shard's default mesh is on the machine's accelerator (CUDA where there is one) whatever the process group:
    # on a GPU machine a CPU run would put its shards on the GPU. A mesh on the CPU, through accelerate's own seam.
    parallelism = ParallelismConfig(dp_shard_size=accelerator.num_processes)
    accelerator.state.parallelism_config = parallelism
    accelerator.state.device_mesh = parallelism.get_device_mesh("cpu")
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP  # the collectives (gather, barrier) read this one
    return True
