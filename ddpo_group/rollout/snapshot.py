"""What the sampling phase of an epoch changes, saved when the epoch starts.

Sampling advances the prompt sampler, feeds the per-prompt stat tracker and may draw from the
global random generators. When a stop signal makes the trainer abandon an epoch before its first
update, restoring this snapshot puts every piece of state back where the previous epoch left it,
so the checkpoint written then resumes exactly.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import torch


class SamplingSnapshot:
    """Deep copies of the given objects' ``state_dict()`` and of the python, numpy and torch RNG states."""

    def __init__(self, *stateful):
        self.objects = stateful
        self.states = [copy.deepcopy(obj.state_dict()) for obj in stateful]
        self.python_rng = random.getstate()
        self.numpy_rng = np.random.get_state()
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self) -> None:
        for obj, state in zip(self.objects, self.states):
            obj.load_state_dict(copy.deepcopy(state))
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
