"""Tabulate and plot the learning-rate sweeps of today's baselines (issue 23).

Each sweep is ``benchmarks/tune_digits.py --stage baseline`` on one optimizer
(the commands are in docs/results.md and in ``SETUPS`` below), which writes
``<sweeps>/<optimizer>/tune.json``.  This script reads them, picks each
optimizer's lr and writes one JSON, one PNG and the markdown table of
docs/results.md.  The pick: of the lrs that reached the target in the fewest
steps (read every 20 steps, so neighbouring lrs often tie), the middle one
(the lower middle of an even count): the centre of the plateau, not its
edge, where one more seed could fall off.  Time is not used: the machine is
shared and its load moves it.
Nothing is asserted: speed is reported, never tested.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Setup:
    """What one task's sweeps were: the command, the target, the reference line."""

    #: ``tune_digits.py`` for one optimizer (``{optimizer}``, ``{lrs}`` filled in)
    command: str
    target: float
    #: steps of the whole schedule: a run that misses the target trains them all
    total_steps: int
    read_every: int
    #: the tuned AdamW's steps to the target, drawn for reference, and its label
    adamw_steps: int
    adamw_label: str
    title: str


_SWEEP = (
    "python benchmarks/tune_digits.py --stage baseline --task {task} "
    '--kaisa-args "--optimizer {{optimizer}} --evals-per-epoch {evals} --stop-at-target" '
    "--lrs {{lrs}} --schedules {schedule} --seeds 1 --threads 1 "
    "--out {out}/{{optimizer}}"
)


def _text_cnn(schedule: str, out: str, adamw_label: str, title: str) -> Setup:
    """A text-cnn sweep (3 epochs of 200 steps, read every 10, target 2.5)."""
    return Setup(
        _SWEEP.format(task="text-cnn", evals=20, schedule=schedule, out=out),
        target=2.5,
        total_steps=600,
        read_every=10,
        adamw_steps=160,
        adamw_label=adamw_label,
        title=title,
    )


#: Every task swept so far: one seed, the task's schedule (cosine; a quarter epoch
#: of warm-up, or none for ``-nowarmup``), each run stopped at the target.
SETUPS = {
    "text-lm": Setup(
        _SWEEP.format(task="text-lm", evals=10, schedule="cosine:0.25", out="runs/tune-baselines"),
        target=2.5,
        total_steps=1000,
        read_every=20,
        adamw_steps=360,
        adamw_label="tuned AdamW, lr 0.002 (issue 10)",
        title="text-lm: lr sweeps of today's baselines (1 seed, cosine over 5 epochs, "
        "warm-up 0.25)",
    ),
    "text-cnn": _text_cnn(
        "cosine:0.25",
        "runs/tune-baselines-text-cnn",
        "tuned AdamW, lr 0.01 (issue 10)",
        "text-cnn: lr sweeps of today's baselines (1 seed, cosine over 3 epochs, warm-up 0.25)",
    ),
    "text-cnn-nowarmup": _text_cnn(
        "cosine:0",
        "runs/tune-baselines-text-cnn-nw",
        "tuned AdamW, lr 0.01, with its warm-up (issue 10)",
        "text-cnn: today's baselines without warm-up (1 seed, cosine over 3 epochs)",
    ),
}


def _value(spread: dict[str, Any], key: str = "median") -> float:
    value = spread[key]
    return math.inf if value is None else float(value)


def choose(rows: Sequence[dict[str, Any]]) -> float:
    """The middle lr of those that reached the target (every seed) in the fewest steps."""
    reached = [r for r in rows if r["reached"] == r["n_seeds"]]
    if not reached:
        raise ValueError("no lr reached the target")
    fewest = min(_value(r["steps_to_target"]) for r in reached)
    best = sorted(r["settings"]["lr"] for r in reached if _value(r["steps_to_target"]) == fewest)
    return float(best[(len(best) - 1) // 2])


def load(sweeps: Path, optimizers: Sequence[str], setup: Setup) -> dict[str, Any]:
    """Every optimizer's rows (lr order) and its chosen lr."""
    out: dict[str, Any] = {}
    for name in optimizers:
        path = sweeps / name / "tune.json"
        if not path.exists():
            continue
        rows = sorted(json.loads(path.read_text())["baseline"], key=lambda r: r["settings"]["lr"])
        lrs = " ".join(f"{r['settings']['lr']:g}" for r in rows)
        out[name] = {
            "command": setup.command.format(optimizer=name, lrs=lrs),
            # None: no lr reached the target (e.g. LAMB without its warm-up)
            "chosen_lr": choose(rows) if any(r["reached"] for r in rows) else None,
            "rows": [
                {
                    "lr": r["settings"]["lr"],
                    "steps_to_target": r["steps_to_target"]["median"],
                    "final_bits_per_char": r["final_metric"]["median"],
                    "train_time_s": r["wall_time_s"]["median"],
                    "load_1min": r["load_1min"],
                }
                for r in rows
            ],
        }
    return out


def table(results: dict[str, Any], setup: Setup) -> str:
    """The markdown table: one row per optimizer and lr, the chosen lr in bold."""
    lines = [
        f"| optimizer | lr | steps to {setup.target:g} bits/char | bits/char where it stopped | "
        "training time (s) | 1-min load before / after |",
        "|---|---|---|---|---|---|",
    ]
    for name, sweep in results.items():
        for row in sweep["rows"]:
            chosen = row["lr"] == sweep["chosen_lr"]
            steps = "missed" if row["steps_to_target"] is None else f"{row['steps_to_target']:g}"
            lr = f"**{row['lr']:g}**" if chosen else f"{row['lr']:g}"
            load = " / ".join(f"{v:.1f}" for v in row["load_1min"])
            lines.append(
                f"| {name} | {lr} | {steps} | {row['final_bits_per_char']:.3f} | "
                f"{row['train_time_s']:.0f} | {load} |"
            )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path, setup: Setup) -> None:
    """Steps to target (a missed target drawn at the top) and end-of-run bits/char per lr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (steps_ax, metric_ax) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    ceiling = setup.total_steps * 1.05
    for name, sweep in results.items():
        lrs = [r["lr"] for r in sweep["rows"]]
        steps = [
            ceiling if r["steps_to_target"] is None else r["steps_to_target"] for r in sweep["rows"]
        ]
        (line,) = steps_ax.plot(
            lrs, steps, marker="o", label=f"{name} (chosen {sweep['chosen_lr'] or '-'})"
        )
        metric_ax.plot(
            lrs,
            [r["final_bits_per_char"] for r in sweep["rows"]],
            marker="o",
            color=line.get_color(),
        )
    steps_ax.axhline(ceiling, color="gray", ls=":", lw=1)
    steps_ax.axhline(setup.adamw_steps, color="black", ls="--", lw=1, label=setup.adamw_label)
    steps_ax.text(
        steps_ax.get_xlim()[0],
        ceiling,
        f" missed the target ({setup.total_steps} steps)",
        va="bottom",
        fontsize=7,
    )
    metric_ax.axhline(setup.target, color="gray", ls="--", lw=1, label=f"target {setup.target:g}")
    for ax in (steps_ax, metric_ax):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3)
    steps_ax.set_ylabel(f"steps to {setup.target:g} bits/char (read every {setup.read_every})")
    metric_ax.set_ylabel("bits/char where the run stopped")
    steps_ax.legend(fontsize="small")
    metric_ax.legend(fontsize="small")
    fig.suptitle(setup.title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--setup", choices=sorted(SETUPS), default="text-lm", help="which task's sweeps these are"
    )
    parser.add_argument("--sweeps", type=Path, default=Path("runs/tune-baselines"))
    parser.add_argument("--optimizers", nargs="+", default=["muon", "soap", "shampoo", "lamb"])
    parser.add_argument("--json", type=Path, default=Path("docs/tune-baselines-text-lm.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/tune-baselines-text-lm.png"))
    args = parser.parse_args(argv)
    setup = SETUPS[args.setup]
    results = load(args.sweeps, args.optimizers, setup)
    args.json.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    plot(results, args.png, setup)
    print(table(results, setup))
    for name, sweep in results.items():
        print(f"{name}: chosen lr {sweep['chosen_lr']}\n  {sweep['command']}")
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
