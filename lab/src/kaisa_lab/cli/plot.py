"""The PNG of a command: metric against training time and against epochs.

Two panels because they answer different questions: per epoch shows how much
each step of K-FAC is worth, per second whether it pays for its extra cost.
Drawn from the ``results.json`` objects so a saved file can be re-plotted.

With several seeds each arm is a band: at every epoch, the median over seeds
of the training time (x) and of the metric (y), shaded between the seeds'
minimum and maximum metric, and darker between the quartiles from four seeds
on. Epochs are the common axis because every seed evaluates at the same
epochs, whereas their clocks differ; a seed that stopped early (target reached
with ``--stop-at-target``, or diverged) leaves the later epochs to the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kaisa_lab.cli.summary import MIN_SEEDS_FOR_IQR, quantile, to_target_values

__all__ = ["plot_runs", "seed_bands"]


def seed_bands(seeds: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per epoch, over the seeds that evaluated it: median time, and metric statistics.

    Keys: ``epoch``, ``time`` (median training time), ``median``, ``min``,
    ``max`` and, from :data:`MIN_SEEDS_FOR_IQR` seeds, ``q1`` and ``q3``
    (metrics). A metric written as null (NaN) is left out.
    """
    by_epoch: dict[int, list[tuple[float, float]]] = {}
    for seed in seeds:
        for point in seed["curve"]:
            if point["metric"] is not None:
                by_epoch.setdefault(point["epoch"], []).append(
                    (point["wall_time_s"], point["metric"])
                )
    bands: dict[str, list[float]] = {k: [] for k in ("epoch", "time", "median", "min", "max")}
    quartiles = len(seeds) >= MIN_SEEDS_FOR_IQR
    if quartiles:
        bands.update(q1=[], q3=[])
    for epoch in sorted(by_epoch):
        times = [t for t, _ in by_epoch[epoch]]
        metrics = [m for _, m in by_epoch[epoch]]
        bands["epoch"].append(epoch)
        bands["time"].append(quantile(times, 0.5))
        bands["median"].append(quantile(metrics, 0.5))
        bands["min"].append(min(metrics))
        bands["max"].append(max(metrics))
        if quartiles:
            bands["q1"].append(quantile(metrics, 0.25))
            bands["q3"].append(quantile(metrics, 0.75))
    return bands


def _draw_band(by_time: Any, by_epoch: Any, run: Mapping[str, Any]) -> None:
    seeds = run["seeds"]
    bands = seed_bands(seeds)
    shading = "min-max, IQR" if "q1" in bands else "min-max"
    label = f"{run['name']} (median of {len(seeds)} seeds, {shading})"
    (line,) = by_time.plot(bands["time"], bands["median"], marker="o", ms=3, label=label)
    color = line.get_color()
    by_epoch.plot(bands["epoch"], bands["median"], marker="o", ms=3, color=color)
    for ax, x in ((by_time, bands["time"]), (by_epoch, bands["epoch"])):
        ax.fill_between(x, bands["min"], bands["max"], color=color, alpha=0.15, lw=0)
        if "q1" in bands:
            ax.fill_between(x, bands["q1"], bands["q3"], color=color, alpha=0.3, lw=0)
    median_time = quantile(to_target_values(seeds, "time_to_target_s"), 0.5)
    if median_time != float("inf"):
        by_time.axvline(median_time, color=color, lw=0.8, alpha=0.4)


def _draw_line(by_time: Any, by_epoch: Any, run: Mapping[str, Any]) -> None:
    curve = run["curve"]
    values = [p["metric"] for p in curve]
    (line,) = by_time.plot(
        [p["wall_time_s"] for p in curve], values, marker="o", ms=3, label=run["name"]
    )
    by_epoch.plot([p["epoch"] for p in curve], values, marker="o", ms=3, color=line.get_color())
    if run.get("time_to_target_s") is not None:
        by_time.axvline(run["time_to_target_s"], color=line.get_color(), lw=0.8, alpha=0.4)


def plot_runs(runs: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Save a two-panel figure of ``runs`` (``results.json`` objects) to ``path``.

    An arm with more than one seed is drawn as a band, otherwise as a line.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe on servers and in tests
    import matplotlib.pyplot as plt

    fig, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    metric = runs[0]["metric_name"] if runs else "metric"
    for run in runs:
        if len(run.get("seeds", ())) > 1:
            _draw_band(by_time, by_epoch, run)
        else:
            _draw_line(by_time, by_epoch, run)
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
