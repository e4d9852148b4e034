"""Table, JSON and plot of the text-lm-large budget runs (docs/results.md, issue 23 item 3).

Reads the ``EVAL`` lines that ``benchmarks/train_logged.py`` prints (one log
per arm, ``NAME.log``), so runs stopped by hand after the target are read as
far as they went.  For each arm: steps to each target in ``--targets`` (the
first reading at or below it; ``-`` where the run had not got there when it
ended), the last reading, and the CPU seconds per step of the whole run
(training and evaluations over steps: the load-independent cost of a run on
one thread).  With ``--step-cost`` (``benchmarks/arm_step_cost.py --json``)
the table adds each arm's interleaved step cost relative to AdamW, and after
each step count, in brackets, the time to that target in AdamW steps (steps
times that cost).

    python benchmarks/large_lm_report.py runs/large-*.log --targets 2.2 2.1 2.0 \\
        --step-cost docs/text-lm-large-step-cost.json \\
        --json docs/text-lm-large.json --png docs/text-lm-large.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_EVAL = re.compile(
    r"EVAL step (\d+) metric ([\d.]+) train_loss ([\d.naif]+) train_time ([\d.]+) "
    r"cpu ([\d.]+) load ([\d.]+) wall (\d+)"
)


def read_log(path: Path) -> list[dict[str, float]]:
    """The readings of one log, in order."""
    keys = ("step", "metric", "train_loss", "train_time_s", "cpu_s", "load_1min", "wall")
    rows = []
    for line in path.read_text().splitlines():
        m = _EVAL.search(line)
        if m:
            rows.append({k: float(v) for k, v in zip(keys, m.groups())})
    return rows


def steps_to(curve: list[dict[str, float]], target: float) -> int | None:
    """The step of the first reading at or below ``target`` (bits/char: lower is better)."""
    return next((int(r["step"]) for r in curve if r["metric"] <= target), None)


_OPTIMIZERS = ("sgd", "adam", "adamw", "muon", "soap", "shampoo", "lamb")


def _arm_of(name: str) -> str:
    """``large-adamw-kfac-0.001`` -> ``adamw+kfac`` (the key of the step-cost JSON)."""
    parts = name.split("-")
    opt = next((p for p in parts if p in _OPTIMIZERS), parts[0])
    return opt + ("+kfac" if "kfac" in parts else "")


def report(logs: list[Path], targets: list[float], cost: dict[str, Any] | None) -> dict[str, Any]:
    """Every arm's curve and steps to each target, as written to ``--json``."""
    arms: dict[str, Any] = {}
    for path in logs:
        curve = read_log(path)
        if not curve:
            continue
        last = curve[-1]
        arms[path.stem] = {
            "curve": curve,
            "steps_to": {str(t): steps_to(curve, t) for t in targets},
            "last_step": int(last["step"]),
            "last_metric": last["metric"],
            "cpu_s_per_step": last["cpu_s"] / last["step"],
            "load_1min_range": [
                min(r["load_1min"] for r in curve),
                max(r["load_1min"] for r in curve),
            ],
        }
        if cost is not None and _arm_of(path.stem) in cost["median"]:
            rel = cost["median"][_arm_of(path.stem)]["cpu_ms"] / cost["median"]["adamw"]["cpu_ms"]
            arms[path.stem]["step_cost_vs_adamw"] = rel
    return {"targets": targets, "arms": arms, "step_cost": cost}


def print_table(out: dict[str, Any]) -> None:
    targets = out["targets"]
    head = " | ".join(f"steps to {t}" for t in targets)
    print(f"| run | {head} | last step | bits/char there | CPU s/step (run) | step cost vs AdamW |")
    print("|---|" + "---|" * (len(targets) + 4))
    for name, arm in out["arms"].items():
        rel_cost = arm.get("step_cost_vs_adamw")

        def cell(t: float, arm: dict[str, Any] = arm, rel_cost: float | None = rel_cost) -> str:
            steps = arm["steps_to"][str(t)]
            if steps is None:
                return "-"
            return str(steps) if rel_cost is None else f"{steps} ({steps * rel_cost:.0f})"

        cells = " | ".join(cell(t) for t in targets)
        print(
            f"| {name} | {cells} | {arm['last_step']} | {arm['last_metric']:.3f} | "
            f"{arm['cpu_s_per_step']:.2f} | {'' if rel_cost is None else f'{rel_cost:.2f}'} |"
        )


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, arm in out["arms"].items():
        steps = [r["step"] for r in arm["curve"]]
        ax.plot(steps, [r["metric"] for r in arm["curve"]], label=name)
    for t in out["targets"]:
        ax.axhline(t, color="grey", lw=0.6, ls=":")
    ax.set_ylim(top=3.2, bottom=min(out["targets"]) - 0.15)
    ax.set_xlabel("step (batch 32)")
    ax.set_ylabel("validation bits/char (fixed 256-window slice)")
    ax.set_title("text-lm-large: 4 blocks x 256, one seed, one thread")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--targets", nargs="+", type=float, required=True)
    parser.add_argument("--step-cost", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    cost = json.loads(args.step_cost.read_text()) if args.step_cost else None
    out = report(args.logs, args.targets, cost)
    print_table(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.png:
        plot(out, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
