"""Tolerances from float32 arithmetic, for checks that two code paths compute the same value.

Adding n float32 terms in one order or another gives sums that differ by at most about n * eps * max|term|
(eps = 2**-23: each partial sum rounds by at most half of it; Higham, Accuracy and Stability of Numerical Algorithms,
ch. 4). Chunk sizes, batch sizes and torch's thread count change the order of the reductions in convolutions,
matmuls and gradient accumulation, so a check written with this bound passes with 1, 2 or 4 threads alike; a wrong
factor, a sign error or a dropped term moves a value by about a term's size, far above it.
"""

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23 = 1.19e-7


def reordered_sum_atol(reference: torch.Tensor, terms: int) -> float:
    """Absolute tolerance for a float32 tensor whose entries are sums of ``terms`` products, added in another order:
    terms * eps * the tensor's largest entry (which stands for the size of its terms)."""
    return terms * EPS32 * float(reference.abs().max())
