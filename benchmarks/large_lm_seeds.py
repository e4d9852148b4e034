"""Several seeds of the text-lm-large runs: per-seed and median steps and time to each target.

Reads the JSONs that ``benchmarks/large_lm_report.py --json`` wrote, one per
seed (``SEED=PATH``; several for one seed are merged, a later one's arm
replacing an earlier one's of the same name), and matches arms across them by name (a leading
``sN-`` on a name is dropped, so ``s2-large-muon-0.02`` is ``large-muon-0.02``).
For each arm and target: the steps on every seed and their median; time is
steps times the arm's interleaved step cost (``--step-cost``, the JSON of
``benchmarks/arm_step_cost.py``), in AdamW steps, and the median time is
given relative to ``--relative-to`` arms (the median of the arm's times over
its seeds divided by that of the reference's).  A run that trained its whole
schedule (``--schedule-steps``) without reaching a target counts as never
reaching it (``never``: infinitely slow in the median); one stopped by hand
before its schedule's end and before the target is left out of that
target's median (``stopped``).

    python benchmarks/large_lm_seeds.py 0=docs/text-lm-large.json 1=docs/text-lm-large-seed1.json \\
        2=docs/text-lm-large-seed2.json --targets 2.5 2.2 2.1 2.05 2.03 \\
        --step-cost docs/text-lm-large-step-cost-quiet.json \\
        --relative-to large-muon-0.02 large-adamw-0.001 --json out.json --png out.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from large_lm_report import _arm_of


def _name(stem: str) -> str:
    """``s2-large-muon-0.02`` -> ``large-muon-0.02``: the arm, whatever the seed."""
    return re.sub(r"^s\d+-", "", stem)


def _median(values: list[Any]) -> float:
    """Median where a run that never reached the target counts as infinitely slow
    (NaN where no seed ran far enough to say)."""
    return float(statistics.median(values)) if values else math.nan


def _cost(cost: dict[str, Any], name: str) -> float:
    """The arm's interleaved CPU ms per step; NaN where it was not measured (no time then)."""
    return float(cost["median"].get(_arm_of(name), {}).get("cpu_ms", math.nan))


def _steps(arm: dict[str, Any], target: float, schedule_steps: int) -> int | str:
    """Steps to ``target``, or ``never`` (whole schedule run) or ``stopped`` (cut short)."""
    steps = arm["steps_to"].get(str(target))
    if steps is not None:
        return int(steps)
    return "never" if arm["last_step"] >= schedule_steps else "stopped"


def gather(
    per_seed: dict[str, dict[str, Any]],
    targets: list[float],
    cost: dict[str, Any],
    schedule_steps: int,
) -> dict[str, Any]:
    """``{arm: {"steps": {target: {seed: steps|never|stopped}}, "median_steps": ..., ...}}``."""
    arms: dict[str, Any] = {}
    adamw = cost["median"]["adamw"]["cpu_ms"]
    for seed, report in per_seed.items():
        for stem, arm in report["arms"].items():
            name = _name(stem)
            entry = arms.setdefault(
                name,
                {
                    "step_cost_vs_adamw": _cost(cost, name) / adamw,
                    "steps": {str(t): {} for t in targets},
                    "curves": {},
                },
            )
            entry["curves"][seed] = arm["curve"]
            for t in targets:
                entry["steps"][str(t)][seed] = _steps(arm, t, schedule_steps)
    for entry in arms.values():
        entry["median_steps"] = {
            t: _median(
                [math.inf if s == "never" else s for s in by_seed.values() if s != "stopped"]
            )
            for t, by_seed in entry["steps"].items()
        }
    return arms


def relative_times(arms: dict[str, Any], ref: str) -> dict[str, dict[str, float]]:
    """Each arm's median time over its seeds / ``ref``'s, at every target."""
    out: dict[str, dict[str, float]] = {}
    for name, entry in arms.items():
        out[name] = {}
        for t, med in entry["median_steps"].items():
            ref_med = arms[ref]["median_steps"][t] * arms[ref]["step_cost_vs_adamw"]
            mine = med * entry["step_cost_vs_adamw"]
            out[name][t] = math.nan if math.isinf(ref_med) else mine / ref_med
    return out


def _fmt(x: float | str, digits: int = 0) -> str:
    """A cell: ``never`` for infinity, ``-`` for NaN (no seed ran far enough)."""
    if isinstance(x, str):
        return x
    if math.isnan(x):
        return "-"
    return "never" if math.isinf(x) else f"{x:.{digits}f}"


def print_tables(arms: dict[str, Any], rel: dict[str, dict[str, dict[str, float]]]) -> None:
    """Markdown: steps per seed and median at each target; then median time vs each reference."""
    targets = list(next(iter(arms.values()))["steps"])
    print("| arm | " + " | ".join(f"steps to {t}: per seed; median" for t in targets) + " |")
    print("|---|" + "---|" * len(targets))
    for name, entry in arms.items():
        cells = []
        for t in targets:
            seeds = " / ".join(f"{seed}:{_fmt(s)}" for seed, s in sorted(entry["steps"][t].items()))
            cells.append(f"{seeds}; **{_fmt(entry['median_steps'][t])}**")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for ref, table in rel.items():
        print(f"\nmedian time relative to {ref} (step cost vs AdamW in the second column)\n")
        print("| arm | step cost | " + " | ".join(f"at {t}" for t in targets) + " |")
        print("|---|---|" + "---|" * len(targets))
        for name, by_t in table.items():
            cost = arms[name]["step_cost_vs_adamw"]
            times = " | ".join(_fmt(by_t[t], 2) for t in targets)
            print(f"| {name} | {_fmt(cost, 2)} | {times} |")


def _seeds_label(curves: dict[str, Any]) -> str:
    """``seed 0`` or ``seeds 0, 1, 2``."""
    seeds = sorted(curves)
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(seeds)


def plot(arms: dict[str, Any], targets: list[float], path: Path) -> None:
    """Every seed's curve, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (name, entry) in enumerate(arms.items()):
        for j, (_seed, curve) in enumerate(sorted(entry["curves"].items())):
            ax.plot(
                [r["step"] for r in curve],
                [r["metric"] for r in curve],
                color=f"C{i}",
                lw=1.0,
                alpha=0.85,
                ls=("-", "--", ":", "-.")[j % 4],
                label=f"{name} ({_seeds_label(entry['curves'])})" if j == 0 else None,
            )
    for t in targets:
        ax.axhline(t, color="grey", lw=0.6, ls=":")
    ax.set_ylim(top=3.0, bottom=min(targets) - 0.1)
    ax.set_xlabel("step (batch 32)")
    ax.set_ylabel("validation bits/char (fixed 256-window slice)")
    ax.set_title("text-lm-large: every seed (line style), one thread")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="SEED=PATH of a large_lm_report.py JSON")
    parser.add_argument("--targets", nargs="+", type=float, required=True)
    parser.add_argument("--step-cost", type=Path, required=True)
    parser.add_argument("--relative-to", nargs="+", default=[], metavar="ARM")
    parser.add_argument("--arms", nargs="+", metavar="ARM", help="only these arms (default: all)")
    parser.add_argument(
        "--schedule-steps", type=int, default=1000, help="steps of a whole run (default 1000)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    per_seed: dict[str, dict[str, Any]] = {}
    for spec in args.reports:
        seed, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"reports must be SEED=PATH; got {spec!r}")
        arms_of_seed = per_seed.setdefault(seed, {"arms": {}})["arms"]
        arms_of_seed.update(json.loads(Path(path).read_text())["arms"])
    cost = json.loads(args.step_cost.read_text())
    arms = gather(per_seed, args.targets, cost, args.schedule_steps)
    if args.arms:
        missing = set(args.arms) - set(arms)
        if missing:
            parser.error(f"--arms names no arm: {sorted(missing)}; arms: {sorted(arms)}")
        arms = {name: arms[name] for name in args.arms}
    unknown = set(args.relative_to) - set(arms)
    if unknown:
        parser.error(f"--relative-to names no arm: {sorted(unknown)}; arms: {sorted(arms)}")
    rel = {ref: relative_times(arms, ref) for ref in args.relative_to}
    print_tables(arms, rel)
    if args.json:
        summary = {
            name: {k: v for k, v in entry.items() if k != "curves"} for name, entry in arms.items()
        }
        out = {"targets": args.targets, "reports": args.reports, "arms": summary}
        out["median_time_relative"] = rel
        args.json.write_text(json.dumps(_finite(out), indent=1) + "\n")
    if args.png:
        plot(arms, args.targets, args.png)
    return 0


def _finite(obj: Any) -> Any:
    """``obj`` as plain JSON: infinity (a target never reached) as ``"never"``, NaN as null."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else "never"
    return obj


if __name__ == "__main__":
    raise SystemExit(main())
