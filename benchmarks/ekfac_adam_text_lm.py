"""Table, JSON and plot of the ``ekfac_adam`` measurement on text-lm (issue 23).

Reads the ``results.json`` of ``kaisa compare`` / ``kaisa train`` runs
(docs/results.md gives the commands) and writes, per arm, the steps to the
target (load-independent) and time to target per seed, as a Markdown table on
stdout, a JSON file and a PNG of validation bits/char against steps::

    python benchmarks/ekfac_adam_text_lm.py --out docs/text-lm-ekfac-adam \\
        "AdamW=runs/base:adamw" "AdamW + kaisa (inverse)=runs/base:adamw+kfac" ...

Each argument is ``LABEL=DIR[:RUN]``: the run called RUN in DIR/results.json
(the first run when omitted).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def load_arm(spec: str) -> dict[str, Any]:
    """One arm from ``LABEL=DIR[:RUN]``."""
    label, _, where = spec.partition("=")
    folder, _, run_name = where.partition(":")
    runs = json.loads((Path(folder) / "results.json").read_text())
    run = next(r for r in runs if not run_name or r["name"] == run_name)
    seeds = run.get("seeds") or [run]
    return {
        "label": label,
        "source": spec,
        "lr": _config(run).get("lr"),
        "seeds": [
            {
                "seed": s.get("seed", 0),
                "steps_to_target": s["steps_to_target"],
                "time_to_target_s": s["time_to_target_s"],
                "curve": [(p["step"], p["metric"]) for p in s["curve"]],
            }
            for s in seeds
        ],
    }


def _config(run: dict[str, Any]) -> dict[str, Any]:
    config = run.get("config")
    if isinstance(config, dict):
        return config
    return {}


def _median(values: list[float | None]) -> str:
    """Median [min–max]; a seed that missed the target counts as infinite."""
    if not values:
        return "-"
    finite = [v for v in values if v is not None]
    keyed = sorted(values, key=lambda v: float("inf") if v is None else v)
    mid = keyed[len(keyed) // 2] if len(keyed) % 2 else None
    if len(keyed) % 2 == 0:
        lo, hi = keyed[len(keyed) // 2 - 1], keyed[len(keyed) // 2]
        mid = None if lo is None or hi is None else statistics.median([lo, hi])
    text = "never" if mid is None else f"{mid:g}"
    if finite:
        text += f" [{min(finite):g}–{max(finite):g}]"
    return text


def table(arms: list[dict[str, Any]]) -> str:
    rows = [
        "| arm | lr | seeds | reached | steps to target | time to target (s) |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        steps = [s["steps_to_target"] for s in arm["seeds"]]
        times = [s["time_to_target_s"] for s in arm["seeds"]]
        times = [None if t is None else round(t, 1) for t in times]
        reached = sum(v is not None for v in steps)
        rows.append(
            f"| {arm['label']} | {arm['lr']} | {len(steps)} | {reached}/{len(steps)} | "
            f"{_median(steps)} | {_median(times)} |"
        )
    return "\n".join(rows)


def plot(arms: list[dict[str, Any]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, arm in enumerate(arms):
        color = f"C{i}"
        for j, seed in enumerate(arm["seeds"]):
            steps, metric = zip(*seed["curve"]) if seed["curve"] else ((), ())
            ax.plot(steps, metric, color=color, alpha=0.8, label=arm["label"] if j == 0 else None)
    ax.axhline(target, color="k", lw=0.8, ls="--")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation bits/char")
    ax.set_ylim(target - 0.3, 4.0)
    ax.set_title("text-lm: steps to 2.5 bits/char (one line per seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arms", nargs="+", help="LABEL=DIR[:RUN]")
    parser.add_argument("--out", required=True, help="path stem of the .json and .png")
    parser.add_argument("--target", type=float, default=2.5)
    args = parser.parse_args()
    arms = [load_arm(a) for a in args.arms]
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(arms, indent=1) + "\n")
    plot(arms, out.with_suffix(".png"), args.target)
    print(table(arms))


if __name__ == "__main__":
    main()
