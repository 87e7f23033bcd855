"""Per-prompt reward statistics: DDPO's stat tracker, extended with group statistics.

``PerPromptStatTracker.update(prompts, rewards)`` returns per-sample advantages (float64):

    A_i = (R_i - mean_p) / (std_p + eps)      (use_std=True)
    A_i =  R_i - mean_p                       (use_std=False)

where p is the prompt (its text) of sample i and mean_p, std_p (population std, ddof=0,
as numpy's default used by ddpo-pytorch) come from:

* mode="buffer" (DDPO): each prompt has a FIFO of its last ``buffer_size`` rewards that
  persists across epochs. The prompt's new rewards are appended first; if the FIFO then holds
  at least ``min_count`` rewards its mean/std are used, otherwise the mean/std of the WHOLE
  batch passed to this call (all prompts). Identical to ddpo-pytorch's stat_tracking.py.
* mode="group" (GRPO family): the statistics of the prompt's samples in this call only.
  Each call is one epoch's gathered batch: the tracker is cleared at the start of every
  ``update`` (and by ``clear()``), so ``get_stats()`` always describes the current groups.

Rewards are stored as Python floats / float64 arrays; prompts are keyed by their text.
``get_stats()`` gives per-group count, mean, std, min, max and a zero_std flag
(std <= zero_std_eps) plus aggregates: num_groups, mean_group_std, zero_std_ratio,
mean_group_count, mean_group_mean, min_group_std, max_group_std.
"""

from __future__ import annotations

from collections import deque
from typing import Dict, Optional, Sequence

import numpy as np

_MODES = ("buffer", "group")


def _to_numpy_f64(rewards) -> np.ndarray:
    if hasattr(rewards, "detach"):  # torch tensor, without importing torch here
        rewards = rewards.detach().cpu().double().numpy()
    return np.asarray(rewards, dtype=np.float64).reshape(-1)


class PerPromptStatTracker:
    def __init__(
        self,
        buffer_size: Optional[int],
        min_count: int,
        mode: str = "buffer",
        use_std: bool = True,
        eps: float = 1e-6,
        zero_std_eps: float = 1e-6,
    ):
        if mode not in _MODES:
            raise ValueError(f"unknown stat tracker mode {mode!r}; valid: {list(_MODES)}")
        if buffer_size is not None and buffer_size < 0:
            raise ValueError(f"buffer_size must be >= 0 or None, got {buffer_size}")
        self.buffer_size = buffer_size
        self.min_count = int(min_count)
        self.mode = mode
        self.use_std = bool(use_std)
        self.eps = float(eps)
        self.zero_std_eps = float(zero_std_eps)
        self.stats: Dict[str, deque] = {}

    # ------------------------------------------------------------------ core
    def update(self, prompts: Sequence[str], rewards) -> np.ndarray:
        """Record the rewards and return float64 advantages [B] (module docstring: formulas)."""
        prompts = [str(p) for p in prompts]
        rewards = _to_numpy_f64(rewards)
        if len(prompts) != rewards.shape[0]:
            raise ValueError(f"got {len(prompts)} prompts and {rewards.shape[0]} rewards")
        if not np.all(np.isfinite(rewards)):
            raise ValueError("stat tracker got non-finite rewards")
        if self.mode == "group":
            self.clear()
        advantages = np.zeros_like(rewards)
        if rewards.size == 0:
            return advantages
        uniq, inverse = np.unique(np.asarray(prompts, dtype=object).astype(str), return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        counts = np.bincount(inverse, minlength=len(uniq))
        splits = np.split(order, np.cumsum(counts)[:-1])
        batch_mean = rewards.mean()
        batch_std = rewards.std()
        for prompt, idx in zip(uniq.tolist(), splits):  # one iteration per prompt, not per sample
            r = rewards[idx]
            if self.mode == "buffer":
                buf = self.stats.get(prompt)
                if buf is None:
                    buf = self.stats[prompt] = deque(maxlen=self.buffer_size)
                buf.extend(r.tolist())
                if len(buf) < self.min_count:
                    mean, std = batch_mean, batch_std
                else:
                    arr = np.fromiter(buf, dtype=np.float64, count=len(buf))
                    mean, std = arr.mean(), arr.std()
            else:
                self.stats[prompt] = deque(r.tolist())
                mean, std = r.mean(), r.std()
            centered = r - mean
            advantages[idx] = centered / (std + self.eps) if self.use_std else centered
        return advantages

    def clear(self) -> None:
        self.stats = {}

    # --------------------------------------------------------------- stats
    def get_stats(self) -> dict:
        """{"groups": {prompt: {count, mean, std, min, max, zero_std}}, plus aggregates}."""
        groups = {}
        stds, counts, means, zeros = [], [], [], []
        for prompt, buf in self.stats.items():
            if len(buf) == 0:
                continue
            arr = np.fromiter(buf, dtype=np.float64, count=len(buf))
            std = float(arr.std())
            zero = bool(std <= self.zero_std_eps)
            groups[prompt] = {
                "count": int(arr.size),
                "mean": float(arr.mean()),
                "std": std,
                "min": float(arr.min()),
                "max": float(arr.max()),
                "zero_std": zero,
            }
            stds.append(std)
            counts.append(arr.size)
            means.append(float(arr.mean()))
            zeros.append(zero)
        n = len(groups)
        return {
            "groups": groups,
            "num_groups": n,
            "mean_group_std": float(np.mean(stds)) if n else 0.0,
            "min_group_std": float(np.min(stds)) if n else 0.0,
            "max_group_std": float(np.max(stds)) if n else 0.0,
            "zero_std_ratio": float(np.mean(zeros)) if n else 0.0,
            "mean_group_count": float(np.mean(counts)) if n else 0.0,
            "mean_group_mean": float(np.mean(means)) if n else 0.0,
        }

    def get_metrics(self, prefix: str = "stat_tracker/") -> Dict[str, float]:
        """The aggregates of get_stats() as a flat dict of floats, for logging."""
        stats = self.get_stats()
        return {f"{prefix}{k}": float(v) for k, v in stats.items() if k != "groups"}

    # ---------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        return {
            "mode": self.mode,
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "use_std": self.use_std,
            "eps": self.eps,
            "stats": {p: [float(x) for x in buf] for p, buf in self.stats.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the per-prompt rewards (the configuration of ``self`` is kept; a buffer
        smaller than the saved one keeps the most recent rewards)."""
        if state.get("mode", self.mode) != self.mode:
            raise ValueError(f"stat tracker state has mode {state.get('mode')!r}, tracker has {self.mode!r}")
        maxlen = self.buffer_size if self.mode == "buffer" else None
        self.stats = {str(p): deque((float(x) for x in v), maxlen=maxlen) for p, v in state["stats"].items()}

    def __len__(self) -> int:
        return len(self.stats)
