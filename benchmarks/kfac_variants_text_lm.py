"""Which K-FAC wins on text-lm (issue 23, item 2): table, JSON, plot, step cost.

Two modes.  Given ``LABEL=DIR[:RUN]`` arms (the ``results.json`` of ``kaisa
train`` / ``kaisa compare`` runs, as :mod:`ekfac_adam_text_lm` reads them),
writes the steps to the target per arm (median [min–max] over the seeds;
load-independent) as a Markdown table, ``OUT.json`` and ``OUT.png`` (bits/char
against steps, one line per seed)::

    python benchmarks/kfac_variants_text_lm.py --out docs/text-lm-kfac-variants \\
        "AdamW=runs/x:adamw" "SGD + K-FAC + graft(adam)=runs/y" ...

With ``--time ROUNDS`` it times a training step of each variant on
text-lm's model and batch instead, in blocks of ``--steps`` steps that
alternate between the variants ``ROUNDS`` times after a warm-up block each
(one thread), so every variant sees the same load; ``--cost-json`` adds the
time to target (steps × step cost) against AdamW's and Muon's to the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ekfac_adam_text_lm import _median, load_arm, plot

#: factors every 5 steps with a shorter memory, inverses every 10 (the
#: fresher statistics of the ekfac_adam section of docs/results.md)
_FRESH: dict[str, Any] = {"factor_update_steps": 5, "inv_update_steps": 10, "factor_decay": 0.8}

#: label → (optimizer, K-FAC options or None); K-FAC at text-lm's arm settings
#: (inverse, factors every 10 steps, inverses every 50, damping 0.1, no clip)
VARIANTS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "adamw": ("adamw", None),
    "muon": ("muon", None),
    "adamw+kfac": ("adamw", {}),
    "sgd+kfac": ("sgd", {}),
    "sgd+kfac+graft(adam)": ("sgd", {"grafting": "adam"}),
    "adamw+kfac+graft(adam)": ("adamw", {"grafting": "adam"}),
    "muon+kfac": ("muon", {}),
    "adamw+kfac 5/10": ("adamw", _FRESH),
    "adamw+kfac+graft(adam) 5/10": ("adamw", {**_FRESH, "grafting": "adam"}),
}


def _runner(task: Any, data: Any, optimizer: str, kfac: dict[str, Any] | None) -> Callable:
    import torch

    from kaisa import KFACPreconditioner
    from kaisa_lab.optim.build import build_optimizer

    torch.manual_seed(0)
    model = task.build_model()
    opt = build_optimizer(
        optimizer, model, lr=1e-4, weight_decay=0.0, adamw_lr=1e-4, adamw_weight_decay=0.0
    )
    precond = None
    if kfac is not None:
        options = {**task.defaults.kfac, "loss_average": task.loss_average, **kfac}
        precond = KFACPreconditioner(model, optimizer=opt, **options)
    gen = torch.Generator().manual_seed(0)

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            idx = torch.randint(len(data.train), (32,), generator=gen)
            x, y = data.train.get_batch(idx)
            opt.zero_grad()
            task.loss(model(x), y).backward()
            if precond is not None:
                precond.step()
            opt.step()
        return (time.perf_counter() - start) * 1000.0 / n

    return run


def time_steps(rounds: int, steps: int, only: list[str] | None = None) -> dict[str, list[float]]:
    """Milliseconds per step of each variant (those in ``only``, all if None),
    interleaved blocks (module docstring)."""
    import torch

    from kaisa_lab.tasks.registry import get_task

    torch.set_num_threads(1)
    task = get_task("text-lm")
    data = task.load()
    steps = max(steps, 50)  # a whole inverse interval per block
    chosen = {k: v for k, v in VARIANTS.items() if only is None or k in only}
    runners = {label: _runner(task, data, *spec) for label, spec in chosen.items()}
    for run in runners.values():
        run(steps)
    times: dict[str, list[float]] = {label: [] for label in runners}
    for _ in range(rounds):
        for label, run in runners.items():
            times[label].append(run(steps))
    return times


def load_recorded(spec: str) -> dict[str, Any]:
    """``LABEL=FILE.json#INDEX``: arm INDEX of a JSON this script or
    :mod:`ekfac_adam_text_lm` wrote (an arm measured in another section),
    relabelled."""
    label, _, where = spec.partition("=")
    path, _, index = where.partition("#")
    data = json.loads(Path(path).read_text())
    arm = dict((data["arms"] if isinstance(data, dict) else data)[int(index)])
    arm["label"], arm["source"] = label, spec
    return arm


def relative_cost(times: dict[str, list[float]]) -> dict[str, float]:
    """Each variant's step cost over AdamW's: the median over rounds of the
    ratio of its block to AdamW's block of the same round (neighbours in
    time, so a load that changes between rounds cancels)."""
    base = times["adamw"]
    return {
        label: statistics.median(v / b for v, b in zip(values, base))
        for label, values in times.items()
    }


def table(arms: list[dict[str, Any]], cost: dict[str, float] | None) -> str:
    """Steps to target per arm; with ``cost`` (label → ms/step, matched by the
    arm's ``cost`` key; relative to AdamW's, :func:`relative_cost`) the step
    cost and time to target against AdamW and Muon."""
    rows = [
        "| arm | lr | seeds | reached | steps to target | step cost vs AdamW | "
        "time vs AdamW | time vs Muon |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def steps_of(arm: dict[str, Any]) -> float | None:
        values = [s["steps_to_target"] for s in arm["seeds"]]
        if any(v is None for v in values):
            return None
        return float(statistics.median(values))

    base = {a["cost"]: steps_of(a) for a in arms if a.get("cost") in ("adamw", "muon")}
    for arm in arms:
        steps = [s["steps_to_target"] for s in arm["seeds"]]
        reached = sum(v is not None for v in steps)
        extra = "| - | - | - |"
        key, median = arm.get("cost"), steps_of(arm)
        if cost is not None and key in cost:
            extra = f"| {cost[key]:.2f} |"
            for ref in ("adamw", "muon"):
                ref_steps = base.get(ref)
                if median is None or ref_steps is None:
                    extra += " - |"
                else:
                    extra += f" {median * cost[key] / (ref_steps * cost[ref]):.2f} |"
        rows.append(
            f"| {arm['label']} | {arm['lr']} | {len(steps)} | {reached}/{len(steps)} | "
            f"{_median(steps)} {extra}"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "arms", nargs="*", help="LABEL=DIR[:RUN][,DIR[:RUN]...][@VARIANT] or LABEL=FILE.json#I"
    )
    parser.add_argument("--out", required=True, help="path stem of the .json and .png")
    parser.add_argument("--target", type=float, default=2.5)
    parser.add_argument("--plot", help="comma-separated indices of the arms to plot (all)")
    parser.add_argument("--time", type=int, metavar="ROUNDS", help="time the variants instead")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--variants", help="comma-separated VARIANTS keys to time (all)")
    parser.add_argument("--cost-json", help="the --time output (ms/step per variant)")
    args = parser.parse_args()
    out = Path(args.out)
    if args.time:
        only = None if args.variants is None else args.variants.split(",")
        times = time_steps(args.time, args.steps, only)
        Path(f"{out}.json").write_text(json.dumps(times, indent=1) + "\n")
        rel = relative_cost(times)
        print("| variant | ms/step (median) | vs AdamW (median of per-round ratios) |")
        print("|---|---|---|")
        for label, values in times.items():
            print(f"| {label} | {statistics.median(values):.1f} | {rel[label]:.2f} |")
        return
    arms = []
    for spec in args.arms:
        spec, _, key = spec.partition("@")
        arm = load_recorded(spec) if ".json#" in spec else load_arm(spec)
        arm["cost"] = key or None
        arms.append(arm)
    cost = None
    if args.cost_json:
        cost = relative_cost(json.loads(Path(args.cost_json).read_text()))
    Path(f"{out}.json").write_text(json.dumps({"arms": arms, "ms_per_step": cost}) + "\n")
    shown = arms if not args.plot else [arms[int(i)] for i in args.plot.split(",")]
    plot(shown, Path(f"{out}.png"), args.target)
    print(table(arms, cost))


if __name__ == "__main__":
    main()
