"""The reward curve of a run as a PNG (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from pathlib import Path

FIGSIZE = (9, 4)  # inches; the legend sits right of the axes, outside the data
DPI = 100


def std_band(metrics: list[dict]) -> tuple[list[float], list[float]]:
    """The mean ± 1 std band per epoch, clipped to the range of that epoch's rewards (``reward_min``,
    ``reward_max``): a bounded reward's band never leaves the values it actually took (metrics.jsonl written before
    those fields existed is not clipped)."""
    lower, upper = [], []
    for m in metrics:
        mean, std = m["reward_mean"], m.get("reward_std", 0.0)
        lower.append(max(mean - std, m.get("reward_min", float("-inf"))))
        upper.append(min(mean + std, m.get("reward_max", float("inf"))))
    return lower, upper


def reward_curve_figure(metrics: list[dict], title: str = "", evaluations: list[dict] | None = None):
    """Mean reward per epoch with its ±1 std band (``std_band``) and each ``reward_info/*`` component's mean, and the
    fixed evaluation's mean reward (``evaluations``: eval.jsonl's records, epoch -1 before the first update); the
    legend outside the axes, to the right."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # object API: no pyplot state shared between threads
    from matplotlib.ticker import MaxNLocator

    supervised = [m["epoch"] for m in metrics if "reward_mean" not in m]  # sft.epochs: they sample nothing
    metrics = [m for m in metrics if "reward_mean" in m]
    epochs = [m["epoch"] for m in metrics]
    mean = [m["reward_mean"] for m in metrics]
    lower, upper = std_band(metrics)
    figure = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    axes = figure.add_subplot(1, 1, 1)
    if supervised:  # the epochs fine-tuned on sft.data_dir's images, shaded: the evaluations cover them
        axes.axvspan(min(supervised) - 0.5, max(supervised) + 0.5, color="0.88", zorder=0,
                     label="supervised epochs\n(sft.data_dir)")
    axes.plot(epochs, mean, marker="o", markersize=3, label="reward (mean)")
    clipped = any("reward_min" in m for m in metrics)
    axes.fill_between(epochs, lower, upper, alpha=0.2,
                      label="± 1 std, within the\nepoch's min..max" if clipped else "± 1 std")
    components = sorted({k for m in metrics for k in m if k.startswith("reward_info/") and k.count("/") == 1})
    for key in components:
        points = [(m["epoch"], m[key]) for m in metrics if key in m]
        axes.plot([p[0] for p in points], [p[1] for p in points], linestyle="--", linewidth=1,
                  label=key[len("reward_info/"):])
    evaluated = [(e["epoch"], e["eval/reward_mean"]) for e in evaluations or [] if "eval/reward_mean" in e]
    if evaluated:
        axes.plot([p[0] for p in evaluated], [p[1] for p in evaluated], marker="s", markersize=4, color="black",
                  label="fixed evaluation\n(epoch -1: before training)")
    heldout = [(e["epoch"], e["eval_heldout/reward_mean"]) for e in evaluations or [] if "eval_heldout/reward_mean" in e]
    handles = []
    if heldout:  # eval_reward_fn, on an axis of its own: its scale is not the trained reward's
        right = axes.twinx()
        handles = right.plot([p[0] for p in heldout], [p[1] for p in heldout], marker="D", markersize=4,
                             color="tab:red", label="held-out reward\n(right axis; not trained on)")
        right.set_ylabel("held-out reward", color="tab:red")
        right.tick_params(axis="y", colors="tab:red")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("epoch")
    axes.set_ylabel("reward")
    axes.set_title(title or "reward per epoch")
    axes.grid(alpha=0.3)
    lines = axes.get_legend_handles_labels()[0] + handles
    axes.legend(lines, [line.get_label() for line in lines], loc="upper left", bbox_to_anchor=(1.17 if handles else 1.02,
                1.0), borderaxespad=0.0, fontsize=8)
    return figure


def plot_reward_curve(metrics: list[dict], out_path: str | os.PathLike, title: str = "",
                      evaluations: list[dict] | None = None) -> Path:
    """``reward_curve_figure`` saved to ``out_path`` (written to a temporary file, then renamed)."""
    figure = reward_curve_figure(metrics, title, evaluations)
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.stem + ".tmp.png")
    figure.savefig(tmp)
    os.replace(tmp, out_path)  # a reader never sees a half-written file
    return out_path
