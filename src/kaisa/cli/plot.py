"""The PNG of a command: metric against training time and against epochs.

Two panels because they answer different questions: per epoch shows how much
each step of K-FAC is worth, per second whether it pays for its extra cost.
Drawn from the ``results.json`` objects so a saved file can be re-plotted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_runs"]


def plot_runs(runs: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Save a two-panel figure of ``runs`` (``results.json`` objects) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe on servers and in tests
    import matplotlib.pyplot as plt

    fig, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    metric = runs[0]["metric_name"] if runs else "metric"
    for run in runs:
        curve = run["curve"]
        values = [p["metric"] for p in curve]
        (line,) = by_time.plot(
            [p["wall_time_s"] for p in curve], values, marker="o", ms=3, label=run["name"]
        )
        by_epoch.plot([p["epoch"] for p in curve], values, marker="o", ms=3, color=line.get_color())
        if run.get("time_to_target_s") is not None:
            by_time.axvline(run["time_to_target_s"], color=line.get_color(), lw=0.8, alpha=0.4)
    targets = sorted({run["target"] for run in runs})
    for ax in (by_time, by_epoch):
        for target in targets:
            ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:g}")
        ax.set_ylabel(metric)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    by_time.set_xlabel("training time (s, evaluation excluded)")
    by_epoch.set_xlabel("epoch")
    by_time.legend(loc="best", fontsize="small")
    if runs:
        better = "higher" if runs[0]["higher_is_better"] else "lower"
        fig.suptitle(f"{runs[0]['task']}: {metric} ({better} is better)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
