"""The PNG of a command: metric against training time and against optimizer steps.

Two panels because they answer different questions: per step shows how much
each step of K-FAC is worth, per second whether it pays for its extra cost.
Drawn from the ``results.json`` objects so a saved file can be re-plotted.
A thin vertical line marks where each run first reached the target, on both
panels.

With several seeds each arm is a band: at every evaluation (epoch), the median
over seeds of the training time (x) and of the metric (y), shaded between the
seeds' minimum and maximum metric, and darker between the quartiles from four
seeds on. Evaluations are the common axis because every seed evaluates at the
same steps, whereas their clocks differ; a seed that stopped early (target
reached with ``--stop-at-target``, or diverged) leaves the later evaluations to
the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kaisa_lab.cli.summary import MIN_SEEDS_FOR_IQR, quantile, to_target_values

__all__ = ["plot_runs", "seed_bands"]


def seed_bands(seeds: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per epoch, over the seeds that evaluated it: median time, and metric statistics.

    Keys: ``epoch``, ``step`` (the optimizer step of that evaluation, the same
    for every seed), ``time`` (median training time), ``median``, ``min``,
    ``max`` and, from :data:`MIN_SEEDS_FOR_IQR` seeds, ``q1`` and ``q3``
    (metrics). A metric written as null (NaN) is left out.
    """
    by_epoch: dict[float, list[tuple[float, float]]] = {}
    step_of: dict[float, int] = {}
    for seed in seeds:
        for point in seed["curve"]:
            if point["metric"] is not None:
                by_epoch.setdefault(point["epoch"], []).append(
                    (point["wall_time_s"], point["metric"])
                )
                step_of[point["epoch"]] = point["step"]
    keys = ("epoch", "step", "time", "median", "min", "max")
    bands: dict[str, list[float]] = {k: [] for k in keys}
    quartiles = len(seeds) >= MIN_SEEDS_FOR_IQR
    if quartiles:
        bands.update(q1=[], q3=[])
    for epoch in sorted(by_epoch):
        times = [t for t, _ in by_epoch[epoch]]
        metrics = [m for _, m in by_epoch[epoch]]
        bands["epoch"].append(epoch)
        bands["step"].append(step_of[epoch])
        bands["time"].append(quantile(times, 0.5))
        bands["median"].append(quantile(metrics, 0.5))
        bands["min"].append(min(metrics))
        bands["max"].append(max(metrics))
        if quartiles:
            bands["q1"].append(quantile(metrics, 0.25))
            bands["q3"].append(quantile(metrics, 0.75))
    return bands


def _draw_band(by_time: Any, by_step: Any, run: Mapping[str, Any]) -> None:
    seeds = run["seeds"]
    bands = seed_bands(seeds)
    shading = "min-max, IQR" if "q1" in bands else "min-max"
    label = f"{run['name']} (median of {len(seeds)} seeds, {shading})"
    (line,) = by_time.plot(bands["time"], bands["median"], marker="o", ms=3, label=label)
    color = line.get_color()
    by_step.plot(bands["step"], bands["median"], marker="o", ms=3, color=color)
    for ax, x in ((by_time, bands["time"]), (by_step, bands["step"])):
        ax.fill_between(x, bands["min"], bands["max"], color=color, alpha=0.15, lw=0)
        if "q1" in bands:
            ax.fill_between(x, bands["q1"], bands["q3"], color=color, alpha=0.3, lw=0)
    for ax, key in ((by_time, "time_to_target_s"), (by_step, "steps_to_target")):
        median = quantile(to_target_values(seeds, key), 0.5)
        if median != float("inf"):
            ax.axvline(median, color=color, lw=0.8, alpha=0.4)


def _draw_line(by_time: Any, by_step: Any, run: Mapping[str, Any]) -> None:
    curve = run["curve"]
    values = [p["metric"] for p in curve]
    (line,) = by_time.plot(
        [p["wall_time_s"] for p in curve], values, marker="o", ms=3, label=run["name"]
    )
    color = line.get_color()
    by_step.plot([p["step"] for p in curve], values, marker="o", ms=3, color=color)
    for ax, key in ((by_time, "time_to_target_s"), (by_step, "steps_to_target")):
        if run.get(key) is not None:
            ax.axvline(run[key], color=color, lw=0.8, alpha=0.4)


def plot_runs(runs: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Save a two-panel figure of ``runs`` (``results.json`` objects) to ``path``.

    An arm with more than one seed is drawn as a band, otherwise as a line.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe on servers and in tests
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    metric = runs[0]["metric_name"] if runs else "metric"
    for run in runs:
        if len(run.get("seeds", ())) > 1:
            _draw_band(by_time, by_step, run)
        else:
            _draw_line(by_time, by_step, run)
    targets = sorted({run["target"] for run in runs})
    for ax in (by_time, by_step):
        for target in targets:
            ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:g}")
        ax.set_ylabel(metric)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    by_time.set_xlabel("training time (s, evaluation excluded)")
    by_step.set_xlabel("optimizer steps")
    by_time.legend(loc="best", fontsize="small")
    if runs:
        better = "higher" if runs[0]["higher_is_better"] else "lower"
        fig.suptitle(f"{runs[0]['task']}: {metric} ({better} is better)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
