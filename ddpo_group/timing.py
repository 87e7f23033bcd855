"""Wall time per phase of the epoch (sampling, reward, advantage, training, reference/KL, critic, evaluation,
logging, checkpoint), exclusive: time in a nested phase counts for it, not for the enclosing one.

On CUDA, ``sync=True`` synchronizes at phase boundaries so that queued GPU work is charged to the phase
that queued it (the benchmarks turn it on; the trainer leaves it off: no extra syncs in training).
Use from the main thread only (reward workers are timed separately, see rollout.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("sampling", "reward", "advantage", "training", "reference", "critic", "evaluation", "logging", "checkpoint")


class PhaseTimer:
    def __init__(self, sync: bool = False):
        self.sync = sync
        self.totals: dict[str, float] = defaultdict(float)  # cumulative seconds per phase
        self._stack: list[list] = []  # [name, start of its current exclusive stretch]

    def _now(self) -> float:
        if self.sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        now = self._now()
        if self._stack:  # pause the enclosing phase
            parent = self._stack[-1]
            self.totals[parent[0]] += now - parent[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = self._now()
            _, start = self._stack.pop()
            self.totals[name] += now - start
            if self._stack:  # resume the enclosing phase
                self._stack[-1][1] = now

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)

    @staticmethod
    def since(before: dict, after: dict) -> dict[str, float]:
        return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}


class NullTimer(PhaseTimer):
    """A timer that measures nothing (the default of the modules used outside the trainer)."""

    @contextmanager
    def phase(self, name: str):
        yield


NULL_TIMER = NullTimer()
