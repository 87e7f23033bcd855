"""``config.deterministic=True``: the same run gives the same bits on CUDA, so SIGKILL then resume is bitwise as on
the CPU.

Without it, CUDA kernels that add with atomics (convolution and attention backward, index_put / scatter with
accumulation) sum in a different order on each run, and two runs of the same seed part after the first update.
With it: torch.use_deterministic_algorithms (a deterministic kernel where one exists, an error naming the operation
where none does), cuDNN's deterministic algorithms without autotuning, and cuBLAS with a fixed workspace
(CUBLAS_WORKSPACE_CONFIG, which cuBLAS reads when the process first uses it: set before any CUDA work). The cost
on an H100 is in docs/studies/performance/ (automatic sizes and deterministic mode).
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"  # the value NVIDIA documents for reproducible cuBLAS results


def make_deterministic() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
