"""The one-screen summary printed (and written to summary.txt) at the end of a run."""

from __future__ import annotations

import os
from pathlib import Path


def format_summary(metrics: list[dict], paths: dict[str, str | os.PathLike]) -> str:
    """Reward before (first epoch) and after (last epoch), the best epoch, and where the artefacts are.

    ``metrics`` are the per-epoch records of metrics.jsonl; ``paths`` maps a label to a path
    (only existing paths are listed).
    """
    lines = ["=" * 72, "run summary", "-" * 72]
    if metrics:
        first, last = metrics[0], metrics[-1]
        best = max(metrics, key=lambda m: m["reward_mean"])
        change = last["reward_mean"] - first["reward_mean"]
        lines += [
            f"epochs           {first['epoch']} .. {last['epoch']} ({len(metrics)} logged)",
            f"reward before    {first['reward_mean']:.4f} ± {first.get('reward_std', 0.0):.4f}  (epoch {first['epoch']})",
            f"reward after     {last['reward_mean']:.4f} ± {last.get('reward_std', 0.0):.4f}  (epoch {last['epoch']})",
            f"change           {change:+.4f}",
            f"best epoch       {best['epoch']}: {best['reward_mean']:.4f}",
        ]
        components = sorted(k for k in last if k.startswith("reward_info/") and k.count("/") == 1)
        for key in components:
            if key in first:
                lines.append(f"  {key[len('reward_info/'):]}: {first[key]:.4f} -> {last[key]:.4f}")
    else:
        lines.append("no epoch finished")
    lines.append("-" * 72)
    for label, path in paths.items():
        if path and Path(path).exists():
            lines.append(f"{label:<17}{path}")
    lines.append("=" * 72)
    return "\n".join(lines)
