"""Table, JSON and plot of the ``ekfac_adam`` measurement on text-lm (issue 23).

Reads the ``results.json`` of ``kaisa compare`` / ``kaisa train`` runs
(docs/results.md gives the commands) and writes, per arm, the steps to the
target (load-independent; the JSON keeps each seed's time too, which runs at
different loads do not make comparable), as a Markdown table on stdout, a
JSON file and a PNG of validation bits/char against steps::

    python benchmarks/ekfac_adam_text_lm.py --out docs/text-lm-ekfac-adam \\
        "AdamW=runs/base:adamw" "AdamW + kaisa (inverse)=runs/base:adamw+kfac" ...

Each argument is ``LABEL=DIR[:RUN]``: the run called RUN in DIR/results.json
(the first run when omitted); several ``DIR[:RUN]`` separated by commas
merge their seeds into one arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def load_arm(spec: str) -> dict[str, Any]:
    """One arm from ``LABEL=DIR[:RUN][,DIR[:RUN]…]`` (the seeds of every part)."""
    label, _, where = spec.partition("=")
    seeds, lrs = [], set()
    for part in where.split(","):
        folder, _, run_name = part.partition(":")
        runs = json.loads((Path(folder) / "results.json").read_text())
        run = next(r for r in runs if not run_name or r["name"] == run_name)
        lrs.add(_config(run).get("lr"))
        for s in run.get("seeds") or [run]:
            seeds.append(
                {
                    "seed": s.get("seed", _config(run).get("seed", 0)),
                    "steps_to_target": s["steps_to_target"],
                    "time_to_target_s": s["time_to_target_s"],
                    "curve": [(p["step"], p["metric"]) for p in s["curve"]],
                }
            )
    lr = lrs.pop() if len(lrs) == 1 else sorted(lrs)
    return {"label": label, "source": spec, "lr": lr, "seeds": seeds}


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
        "| arm | lr | seeds | reached | steps to target |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        steps = [s["steps_to_target"] for s in arm["seeds"]]
        reached = sum(v is not None for v in steps)
        rows.append(
            f"| {arm['label']} | {arm['lr']} | {len(steps)} | {reached}/{len(steps)} | "
            f"{_median(steps)} |"
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
    ax.set_ylim(target - 0.3, 3.6)
    ax.set_xlim(0, 420)
    ax.set_title("text-lm: steps to 2.5 bits/char (one line per seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


#: label → (optimizer, compute_method or None, factor_update_steps, inv_update_steps)
ARMS_TIMED: dict[str, tuple[str, str | None, int, int]] = {
    "adamw": ("adamw", None, 0, 0),
    "adamw+kaisa inverse 10/50": ("adamw", "inverse", 10, 50),
    "adamw+kaisa inverse 5/10": ("adamw", "inverse", 5, 10),
    "sgd+kaisa ekfac_adam 10/50": ("sgd", "ekfac_adam", 10, 50),
    "sgd+kaisa ekfac_adam 10/10": ("sgd", "ekfac_adam", 10, 10),
    "sgd+kaisa ekfac_adam 5/10": ("sgd", "ekfac_adam", 5, 10),
}


def time_steps(rounds: int, steps: int) -> dict[str, list[float]]:
    """Milliseconds per training step of each arm on text-lm's model and
    batch (factor and inverse intervals as labelled), timed in blocks of ``steps``
    that alternate between the arms ``rounds`` times (one thread), after a
    warm-up block each: the arms see the same load."""
    import time

    import torch

    from kaisa import KFACPreconditioner
    from kaisa_lab.tasks.registry import get_task

    torch.set_num_threads(1)
    task = get_task("text-lm")
    data = task.load()
    kfac_options = {k: v for k, v in task.defaults.kfac.items() if k != "compute_method"}
    kfac_options["loss_average"] = task.loss_average
    steps = max(steps, 10)  # a whole factor interval per block
    runners = {}
    for label, (opt_name, method, factor_steps, inv_steps) in ARMS_TIMED.items():
        torch.manual_seed(0)
        model = task.build_model()
        if opt_name == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        precond = (
            None
            if method is None
            else KFACPreconditioner(
                model,
                compute_method=method,
                **{
                    **kfac_options,
                    "factor_update_steps": factor_steps,
                    "inv_update_steps": inv_steps,
                },
            )
        )
        gen = torch.Generator().manual_seed(0)

        def run(n: int, model=model, opt=opt, precond=precond, gen=gen) -> float:
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

        run(steps)
        runners[label] = run
    times: dict[str, list[float]] = {label: [] for label in runners}
    for _ in range(rounds):
        for label, run in runners.items():
            times[label].append(run(steps))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arms", nargs="*", help="LABEL=DIR[:RUN]")
    parser.add_argument("--out", required=True, help="path stem of the .json and .png")
    parser.add_argument("--target", type=float, default=2.5)
    parser.add_argument("--plot", help="comma-separated indices of the arms to plot (all)")
    parser.add_argument(
        "--time", type=int, metavar="ROUNDS", help="time the arms' steps instead (time_steps)"
    )
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    args = parser.parse_args()
    if args.time:
        times = time_steps(args.time, args.steps)
        Path(args.out).with_suffix(".json").write_text(json.dumps(times, indent=1) + "\n")
        base = statistics.median(times["adamw"])
        for label, values in times.items():
            med = statistics.median(values)
            print(f"| {label} | {med:.1f} | {med / base:.2f} |")
        return
    arms = [load_arm(a) for a in args.arms]
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(arms, indent=1) + "\n")
    shown = arms if not args.plot else [arms[int(i)] for i in args.plot.split(",")]
    plot(shown, out.with_suffix(".png"), args.target)
    print(table(arms))


if __name__ == "__main__":
    main()
