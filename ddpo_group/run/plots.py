"""The reward curve of a run as a PNG (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from pathlib import Path


def plot_reward_curve(metrics: list[dict], out_path: str | os.PathLike, title: str = "") -> Path:
    """Mean reward per epoch with a +-1 std band, and each ``reward_info/*`` component's mean; saved to ``out_path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # object API: no pyplot state shared between threads

    epochs = [m["epoch"] for m in metrics]
    mean = [m["reward_mean"] for m in metrics]
    std = [m.get("reward_std", 0.0) for m in metrics]
    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.add_subplot(1, 1, 1)
    axes.plot(epochs, mean, marker="o", markersize=3, label="reward (mean)")
    axes.fill_between(epochs, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)], alpha=0.2,
                      label="± 1 std")
    components = sorted({k for m in metrics for k in m if k.startswith("reward_info/") and k.count("/") == 1})
    for key in components:
        points = [(m["epoch"], m[key]) for m in metrics if key in m]
        axes.plot([p[0] for p in points], [p[1] for p in points], linestyle="--", linewidth=1, label=key[len("reward_info/"):])
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("epoch")
    axes.set_ylabel("reward")
    axes.set_title(title or "reward per epoch")
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.stem + ".tmp.png")
    figure.savefig(tmp)
    os.replace(tmp, out_path)  # a reader never sees a half-written file
    return out_path
