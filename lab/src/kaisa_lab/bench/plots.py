"""The suite's figures, drawn from the same rows its tables read.

:func:`plot_heldout` is a case's: each arm's held-out time to target and one
seed's curves. :func:`plot_levers_across` is the levers': each lever's time
to target over K-FAC's at the defaults on every case that measured it, the
tie band shaded, so what a lever bought on one family sits beside what it
bought on the others.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.report import TIE, arm_label
from kaisa_lab.bench.rows import heldout_rows, lever_ratios

__all__ = ["across_points", "plot_heldout", "plot_levers_across"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def across_points(campaigns: Sequence[Campaign]) -> list[tuple[str, str, float]]:
    """``(lever, case, paired time ratio)`` for every lever a case held out
    with a finite, positive ratio (a lever or a base that misses the target
    has no point on a ratio axis; the table says so in words)."""
    ratios, _ = lever_ratios(campaigns)
    return [
        (kind, case, r)
        for kind, by_case in ratios.items()
        for case, r in by_case.items()
        if math.isfinite(r) and r > 0
    ]


def plot_levers_across(campaigns: Sequence[Campaign], path: Path) -> None:
    """One row per lever held out somewhere, one marker per case that measured
    it, at its time over K-FAC's at the defaults (log axis; 1 and the tie band
    marked)."""
    plt = _pyplot()
    points = across_points(campaigns)
    levers = list(dict.fromkeys(kind for kind, _, _ in points))
    cases = [c.case.name for c in campaigns if any(p[1] == c.case.name for p in points)]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.38 * max(len(levers), 1)))
    ax.axvspan(1 - TIE, 1 + TIE, color="0.9", label=f"a tie (within {TIE:.0%})")
    ax.axvline(1.0, color="0.5", linewidth=0.8)
    markers = "osD^v<>"
    for i, case in enumerate(cases):
        mine = [(levers.index(k), r) for k, c, r in points if c == case]
        ax.scatter(
            [r for _, r in mine],
            [y + (i - (len(cases) - 1) / 2) * 0.12 for y, _ in mine],
            marker=markers[i % len(markers)],
            color=f"C{i}",
            label=case,
            zorder=3,
        )
    ax.set_yticks(range(len(levers)), levers)
    ax.invert_yaxis()
    ax.set_xscale("log")
    low, high = ax.get_xlim()  # ticks at every tenth: a log axis labels too few here
    ticks = [t / 10 for t in range(math.floor(low * 10), math.ceil(high * 10) + 1)]
    ax.set_xticks(ticks, [f"{t:g}×" for t in ticks])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel(
        "time to target over K-FAC's at the defaults, same base (median paired ratio; "
        "< 1: the lever wins)"
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("each lever on every case that measured it", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heldout(campaign: Campaign, path: Path) -> None:
    """Held-out time to target per arm (median, min–max) and one seed's curves."""
    plt = _pyplot()
    rows = heldout_rows(campaign)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:  # a figure that says so, so that a page can always show it
        fig, ax = plt.subplots(figsize=(8, 1.6))
        ax.axis("off")
        ax.text(0.5, 0.5, f"{campaign.case.name}: no held-out records yet "
                "(kaisa bench status shows where the campaign stands)", ha="center",
                va="center")  # fmt: skip
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    many = len(rows) > 10  # the legend then goes beside the curves, not over them
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(15 if many else 12, 4.5))
    names = [arm_label(r.arm) for r in rows]
    medians = [r.time_s[0] if r.time_s else 0.0 for r in rows]
    lows = [r.time_s[0] - r.time_s[1] if r.time_s else 0.0 for r in rows]
    highs = [r.time_s[2] - r.time_s[0] if r.time_s else 0.0 for r in rows]
    bars.barh(
        names, medians, xerr=[lows, highs], color=["C1" if r.arm.kfac else "C0" for r in rows]
    )
    bars.invert_yaxis()
    bars.set_xlabel("time to target (s), median and range over held-out seeds")
    seed = campaign.protocol.heldout_seeds[0]
    # more arms than the default cycle's 10 colours: one of 20, none repeated
    tab20 = plt.get_cmap("tab20")
    colours = [tab20(i) for i in range(20)] if many else [f"C{i}" for i in range(10)]
    for i, row in enumerate(rows):
        for record in row.records:
            if record["seed"] == seed:
                steps = [p["step"] for p in record["curve"]]
                metric = [p["metric"] for p in record["curve"]]
                curves.plot(
                    steps, metric, label=arm_label(row.arm), color=colours[i % len(colours)]
                )
    target = rows[0].records[0]["result"]["target"] if rows else None
    if target is not None:
        curves.axhline(target, color="grey", linestyle=":", label="target")
    curves.set_xlabel("step")
    curves.set_ylabel(rows[0].records[0]["result"]["metric"] if rows else "metric")
    curves.set_title(f"held-out seed {seed}")
    if many:
        curves.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        curves.legend(fontsize=7)
    title = f"{campaign.case.name}: {campaign.case.description}"
    fig.suptitle(textwrap.fill(title, 130), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
