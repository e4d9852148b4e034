"""Steps on several seeds times an interleaved step cost: time to target per arm.

For issue 23's last measurements (docs/results.md, "The other baselines
tuned"): each arm's steps to the target on seeds 0..N-1 come from a
``benchmarks/tune_digits.py --stage baseline --seeds N`` run of one lr and
schedule (``ARM=DIR``: its run's ``results.json``, which has every seed) or,
for arms measured earlier, are given as numbers (``ARM=70,70,70``, or one
number, a median reported elsewhere); the step cost of each arm is the CPU ms
per step of ``benchmarks/arm_step_cost.py --json`` (the arm's name, or the
part before ``@`` in ``ARM@COST_ARM``: ``adamw+kfac@adamw+kfac``).  Time =
median steps x step cost, given relative to ``--relative-to``.  Writes a
JSON, a PNG and the markdown table.  Nothing is asserted: speed is reported.

    python benchmarks/seeds_vs_step_cost.py muon=70,70,70 soap=runs/cnn-3seeds/soap \\
        --step-cost docs/text-cnn-step-cost-baselines.json --relative-to muon \\
        --json docs/baselines-text-cnn-3seeds.json --png docs/baselines-text-cnn-3seeds.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def arm_steps(source: str) -> tuple[list[float | None], dict[str, Any]]:
    """Per-seed steps (None: missed) and the settings, from a sweep dir or a number list."""
    path = Path(source)
    if path.is_dir():
        (run,) = sorted(path.glob("baseline/*/results.json"))
        (arm,) = json.loads(run.read_text())
        steps = [s["steps_to_target"] for s in arm["seeds"]]
        return steps, {"run": str(run.parent), "seeds": [s["seed"] for s in arm["seeds"]]}
    return [float(v) for v in source.split(",")], {"given": True}


def summarise(arms: list[str], cost: dict[str, Any], reference: str) -> dict[str, Any]:
    """Every arm's seeds, median steps, step cost (CPU ms) and time relative to ``reference``."""
    out: dict[str, Any] = {}
    for spec in arms:
        label, _, source = spec.partition("=")
        name, _, cost_arm = label.partition("@")
        steps, settings = arm_steps(source)
        reached = [s for s in steps if s is not None]
        median = statistics.median(reached) if len(reached) == len(steps) else None
        ms = cost["median"][cost_arm or name]["cpu_ms"]
        out[name] = {"steps": steps, "median_steps": median, "settings": settings,
                     "step_cost_cpu_ms": ms,
                     "time_ms": None if median is None else median * ms}  # fmt: skip
    ref = out[reference]["time_ms"]
    for row in out.values():
        row["time_vs_" + reference] = None if row["time_ms"] is None else row["time_ms"] / ref
    return out


def plot(rows: dict[str, Any], reference: str, title: str, path: Path) -> None:
    """Median steps and time relative to the reference, one bar per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (steps_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    names = list(rows)
    steps_ax.bar(names, [rows[n]["median_steps"] or 0 for n in names], color="tab:blue")
    time_ax.bar(names, [rows[n]["time_vs_" + reference] or 0 for n in names], color="tab:orange")
    time_ax.axhline(1.0, color="black", lw=1)
    time_ax.axhline(0.9, color="gray", ls="--", lw=1, label="0.9x (issue 23's goal)")
    steps_ax.set_ylabel("median steps to target (seeds 0-2)")
    time_ax.set_ylabel(f"time (steps x CPU ms/step) vs {reference}")
    time_ax.legend(fontsize="small")
    for ax in (steps_ax, time_ax):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arms", nargs="+", help="ARM[@COST_ARM]=DIR or ARM[@COST_ARM]=S0,S1,S2")
    parser.add_argument("--step-cost", type=Path, required=True)
    parser.add_argument("--relative-to", required=True)
    parser.add_argument("--title", default="")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--png", type=Path, required=True)
    args = parser.parse_args(argv)
    cost = json.loads(args.step_cost.read_text())
    rows = summarise(args.arms, cost, args.relative_to)
    out = {"step_cost": str(args.step_cost), "load_1min": cost["load_1min"], "arms": rows}
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    plot(rows, args.relative_to, args.title, args.png)
    print(f"| arm | steps per seed | median | CPU ms / step | time vs {args.relative_to} |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        seeds = " / ".join("missed" if s is None else f"{s:g}" for s in r["steps"])
        rel = r["time_vs_" + args.relative_to]
        print(f"| {name} | {seeds} | {r['median_steps']} | {r['step_cost_cpu_ms']:.0f} | "
              f"{'-' if rel is None else f'{rel:.2f}'} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
