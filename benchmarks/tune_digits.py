"""Tune a first-order optimizer, then K-FAC on top of it, for time to target on a task.

Issue 10 asks whether K-FAC reaches the target in at most 0.7x the time of a
*tuned* first-order baseline at the same batch size; a comparison against an
untuned baseline says little. Three stages, each through the real command line
(``kaisa_lab.cli.main.main`` in-process, so every number is what ``kaisa`` itself
measures and writes to ``results.json``):

1. ``baseline``: ``kaisa train --no-kfac`` over learning rates x schedules
   (``--schedule``/``--warmup-epochs``, and the epochs a cosine decays over),
   ``--seeds N`` each; of those that reached the target on every seed, the
   fewest median steps to target wins (every SGD step
   costs the same, so this is the fastest median time, free of machine load;
   ties: the fewer maximum steps, then the faster median time).
2. ``kfac``: ``kaisa train --kfac`` on the winning lr/schedule over damping x
   KL clip x factor/inverse intervals (x compute method), ``--seeds N`` each;
   of those that reached the target on every seed, the fastest median time
   to target wins (ties: fewer median steps).
3. ``confirm``: ``kaisa compare --seeds M`` of the task's current defaults
   and of the tuned pair, so each ratio comes from interleaved runs of both arms.

A later stage reads the earlier stages' winners from ``--out``'s
``tune.json``, so stages can run separately. Prints a table per stage, writes
``tune.json`` and ``tune.png`` (time to target per configuration and per seed).
Nothing is asserted: speed is reported, never tested.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kaisa_lab.cli.main import main as kaisa_main

INF = math.inf


def _run(out: Path, argv: Sequence[str]) -> list[dict[str, Any]]:
    """Run ``kaisa`` in-process (its table swallowed) and return its results.json."""
    threads = torch.get_num_threads()
    load_before = os.getloadavg()[0]
    with contextlib.redirect_stdout(io.StringIO()):
        code = kaisa_main([*argv, "--quiet", "--out", str(out)])
    torch.set_num_threads(threads)
    if code != 0:
        raise RuntimeError(f"kaisa {' '.join(argv)} exited with {code}")
    runs: list[dict[str, Any]] = json.loads((out / "results.json").read_text())
    # The machine may be shared: keep the 1-minute load around each command.
    for run in runs:
        run["load_1min"] = [load_before, os.getloadavg()[0]]
    return runs


def _value(spread: dict[str, Any], key: str) -> float:
    """A summary statistic; null (a missed target) is +infinity."""
    value = spread[key]
    return INF if value is None else float(value)


def _row(label: str, settings: dict[str, Any], arm: dict[str, Any]) -> dict[str, Any]:
    """One table row: the settings and the arm's per-seed outcomes and medians."""
    summary = arm["summary"]
    return {
        "label": label,
        "settings": settings,
        "name": arm["name"],
        "reached": summary["reached"],
        "n_seeds": summary["n_seeds"],
        "time_to_target_s": summary["time_to_target_s"],
        "steps_to_target": summary["steps_to_target"],
        "epochs_to_target": summary["epochs_to_target"],
        "final_metric": summary["final_metric"],
        "metric": arm.get("metric_name", "accuracy"),
        "wall_time_s": summary["wall_time_s"],
        "per_seed_time_s": [s["time_to_target_s"] for s in arm["seeds"]],
        "ratio": summary.get("time_to_target_ratio"),
        "load_1min": arm["load_1min"],
    }


def _rank_key(row: dict[str, Any]) -> tuple[float, ...]:
    """Reached on every seed first, then fastest median time to target, median steps, slowest seed.

    A configuration that missed the target on any seed ranks after every one
    that reached it on all seeds: a default must not fail on some seeds, and
    medians 0.01 s apart are within the machine's noise.
    Baseline rows (no K-FAC) all cost the same per step, so their time is steps
    times a per-step cost that only the machine's load changes: they are
    ranked by median steps first, which a shared machine cannot distort.
    """
    time_s, steps = row["time_to_target_s"], row["steps_to_target"]
    missed = float(row["reached"] < row["n_seeds"])
    by_time = (_value(time_s, "median"), _value(steps, "median"), _value(time_s, "max"))
    if "kfac" in row["name"]:
        return (missed, *by_time)
    return (missed, _value(steps, "median"), _value(steps, "max"), *by_time)


def _schedule_args(schedule: str) -> tuple[list[str], dict[str, Any]]:
    """``cosine:1:5`` -> flags and settings: schedule name, warm-up epochs[, epochs].

    The epoch count is part of a schedule because a cosine decays to 0 at the
    last step: a shorter run anneals sooner, which can reach the target sooner.
    """
    name, *parts = schedule.split(":")
    warmup = parts[0] if parts else "0"
    rest = parts[1:]
    flags = ["--schedule", name, "--warmup-epochs", warmup]
    settings: dict[str, Any] = {"schedule": name, "warmup_epochs": float(warmup), "epochs": None}
    if rest:
        flags += ["--epochs", rest[0]]
        settings["epochs"] = int(rest[0])
    return flags, settings


def _schedule_text(settings: dict[str, Any]) -> str:
    text = f"{settings['schedule']}:{settings['warmup_epochs']:g}"
    return text + (f":{settings['epochs']}" if settings.get("epochs") else "")


def _interval_args(interval: str) -> tuple[list[str], dict[str, Any]]:
    """``10/50`` -> factor update every 10 steps, inverse update every 50."""
    factor, _, inverse = interval.partition("/")
    flags = ["--kfac-factor-update-steps", factor, "--kfac-inv-update-steps", inverse]
    return flags, {"factor_update_steps": int(factor), "inv_update_steps": int(inverse)}


def _common(args: argparse.Namespace, seeds: int) -> list[str]:
    extra = shlex.split(args.kaisa_args)
    return ["--task", args.task, "--seeds", str(seeds), "--threads", str(args.threads), *extra]


def stage_baseline(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The first-order optimizer alone (the task's, or ``--kaisa-args``'s) over lr x schedule."""
    rows = []
    grid = [(lr, sch) for sch in args.schedules for lr in args.lrs]
    for lr, schedule in tqdm(grid, desc="baseline", file=sys.stderr):
        flags, settings = _schedule_args(schedule)
        label = f"lr {lr:g}, {schedule}"
        out = args.out / "baseline" / label.replace(", ", "_").replace(" ", "")
        argv = ["train", "--no-kfac", *_common(args, args.seeds), "--lr", str(lr), *flags]
        (arm,) = _run(out, argv)
        rows.append(_row(label, {"lr": lr, **settings}, arm))
    return rows


def stage_kfac(args: argparse.Namespace, base: dict[str, Any]) -> list[dict[str, Any]]:
    """SGD+K-FAC on the tuned baseline's lr/schedule over damping x clip x intervals x method."""
    sched_flags, _ = _schedule_args(_schedule_text(base))
    grid = [
        (m, iv, d, c)
        for m in args.methods
        for iv in args.intervals
        for d in args.dampings
        for c in args.kl_clips
    ]
    rows = []
    for method, interval, damping, clip in tqdm(grid, desc="kfac", file=sys.stderr):
        iv_flags, iv_settings = _interval_args(interval)
        label = f"{method} {interval} d {damping} clip {clip}"
        if args.kfac_base:
            label += f", lr {base['lr']:g} {_schedule_text(base)}"
        settings = {
            "compute_method": method,
            **iv_settings,
            "damping": float(damping),
            "kl_clip": None if clip == "none" else float(clip),
        }
        flags = [*iv_flags, "--kfac-damping", damping, "--kfac-kl-clip", clip]
        flags += ["--kfac-compute-method", method, "--lr", str(base["lr"]), *sched_flags]
        out = args.out / "kfac" / label.replace(" ", "_").replace("/", "-")
        (arm,) = _run(out, ["train", "--kfac", *_common(args, args.seeds), *flags])
        rows.append(_row(label, {**base, **settings}, arm))
    return rows


def _kfac_flags(settings: dict[str, Any]) -> list[str]:
    clip = settings["kl_clip"]
    return [
        "--kfac-compute-method",
        settings["compute_method"],
        "--kfac-factor-update-steps",
        str(settings["factor_update_steps"]),
        "--kfac-inv-update-steps",
        str(settings["inv_update_steps"]),
        "--kfac-damping",
        repr(settings["damping"]),
        "--kfac-kl-clip",
        "none" if clip is None else repr(clip),
    ]


def stage_confirm(args: argparse.Namespace, best: dict[str, Any]) -> list[dict[str, Any]]:
    """``compare --seeds M``: the task's current defaults, then the tuned pair."""
    common = ["compare", *_common(args, args.confirm_seeds)]
    tuned = [
        "--lr",
        repr(best["lr"]),
        *_schedule_args(_schedule_text(best))[0],
        *_kfac_flags(best),
    ]
    rows = []
    for label, flags in tqdm([("defaults", []), ("tuned", tuned)], desc="confirm", file=sys.stderr):
        sgd, kfac = _run(args.out / "confirm" / label, [*common, *flags])
        rows.append(_row(f"{label}: {sgd['name']}", {"argv": flags}, sgd))
        rows.append(_row(f"{label}: {kfac['name']}", {"argv": flags}, kfac))
    return rows


def _cell(spread: dict[str, Any], spec: str) -> str:
    def fmt(key: str) -> str:
        value = _value(spread, key)
        return "inf" if math.isinf(value) else format(value, spec)

    return f"{fmt('median')} [{fmt('min')}-{fmt('max')}]"


def format_rows(title: str, rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table: median [min-max] over seeds, fastest median time first."""
    metric = rows[0].get("metric", "accuracy") if rows else "accuracy"
    lines = [
        f"### {title}",
        "",
        "| configuration | reached | time to target (s) | steps to target | epochs | "
        f"final {metric} | train time (s) | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=_rank_key) if "confirm" not in title else rows:
        lines.append(
            f"| {row['label']} | {row['reached']}/{row['n_seeds']} | "
            f"{_cell(row['time_to_target_s'], '.2f')} | {_cell(row['steps_to_target'], 'g')} | "
            f"{_cell(row['epochs_to_target'], 'g')} | {_cell(row['final_metric'], '.4f')} | "
            f"{_cell(row['wall_time_s'], '.2f')} | "
            f"{row['load_1min'][0]:.1f}-{row['load_1min'][1]:.1f} |"
        )
    ratios = [f"{r['label']}: {r['ratio']:.2f}" for r in rows if r.get("ratio") is not None]
    if ratios:
        lines += ["", "median time to target, K-FAC / baseline: " + "; ".join(ratios)]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Median time to target (min-max bars, seeds as dots) of every configuration, per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [s for s in ("baseline", "kfac", "confirm") if results.get(s)]
    heights = [0.16 * len(results[s]) + 0.9 for s in stages]
    fig, axes = plt.subplots(
        len(stages),
        1,
        figsize=(9, sum(heights) + 0.5),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
        layout="constrained",
    )
    for ax, stage in zip(axes[:, 0], stages):
        rows = results[stage] if stage == "confirm" else sorted(results[stage], key=_rank_key)
        medians = [_value(r["time_to_target_s"], "median") for r in rows]
        # Seeds slowed by other load on the machine would squash the axis: cut it at
        # 3x the fastest median and count what lies beyond.
        limit = 3.0 * min(medians) if math.isfinite(min(medians)) else 1.0
        for y, row in enumerate(rows):
            times = [INF if t is None else t for t in row["per_seed_time_s"]]
            shown = [t for t in times if t <= limit]
            color = "tab:orange" if "kfac" in row["name"] else "tab:blue"
            ax.scatter(shown, [y] * len(shown), s=12, color=color, alpha=0.5)
            if medians[y] <= limit:
                ax.plot([medians[y]], [y], marker="|", markersize=10, color=color)
            missed, beyond = times.count(INF), len(times) - len(shown) - times.count(INF)
            note = ", ".join(
                text
                for count, text in ((missed, f"{missed} missed"), (beyond, f"{beyond} beyond"))
                if count
            )
            if note:
                ax.annotate(
                    note,
                    (1.0, y),
                    xycoords=("axes fraction", "data"),
                    ha="right",
                    va="center",
                    fontsize=6,
                    color="tab:red",
                )
        ax.set_xlim(0, limit * 1.05)
        ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=6)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlabel("time to target (s): seeds as dots, median as bar", fontsize=8)
        ax.set_title(
            f"{stage} ({results.get('task', '')}, fastest first)"
            if stage != "confirm"
            else "confirm: kaisa compare",
            fontsize=9,
        )
        ax.grid(axis="x", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--stage", choices=("baseline", "kfac", "confirm", "all", "plot"), default="all"
    )
    parser.add_argument("--task", default="digits-cnn")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.02, 0.035, 0.05, 0.07, 0.1])
    parser.add_argument(
        "--schedules", nargs="+", default=["constant:0", "cosine:1"], help="name:warm-up epochs"
    )
    parser.add_argument("--dampings", nargs="+", default=["0.001", "0.003", "0.01", "0.03"])
    parser.add_argument("--kl-clips", nargs="+", default=["0.001", "0.01", "none"])
    parser.add_argument("--intervals", nargs="+", default=["1/10", "5/50"], help="factor/inverse")
    parser.add_argument("--methods", nargs="+", default=["eigen"], help="eigen and/or inverse")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--confirm-seeds", type=int, default=5)
    parser.add_argument(
        "--kfac-base",
        metavar="LR@SCHEDULE",
        help="run the kfac stage on this lr and schedule (e.g. 0.1@cosine:0.25:1) instead of "
        "the tuned baseline's; for a second look, reported as such",
    )
    parser.add_argument(
        "--append", action="store_true", help="add this stage's rows to those in tune.json"
    )
    parser.add_argument(
        "--kaisa-args",
        default="",
        metavar="ARGS",
        help="more kaisa options for every command of every stage, as one string (e.g. "
        "'--optimizer adamw --evals-per-epoch 4 --stop-at-target')",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/tune"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    path = args.out / "tune.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    results["task"] = args.task
    results.setdefault("started", []).append(time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    keep = args.append and args.stage != "all"
    if args.stage == "plot":
        args.stage = "none"
    if args.stage in ("baseline", "all"):
        results["baseline"] = (results.get("baseline", []) if keep else []) + stage_baseline(args)
    if args.stage in ("kfac", "all"):
        if args.kfac_base:  # needs no baseline stage
            lr, _, schedule = args.kfac_base.partition("@")
            base = {"lr": float(lr), **_schedule_args(schedule)[1]}
        else:
            base = min(results["baseline"], key=_rank_key)["settings"]
        results["kfac"] = (results.get("kfac", []) if keep else []) + stage_kfac(args, base)
    if args.stage in ("confirm", "all"):
        tuned = min(results["baseline"], key=_rank_key)["settings"]
        # Only K-FAC rows on the tuned baseline's lr/schedule (not a --kfac-base second look).
        on_tuned = [
            r for r in results["kfac"] if all(r["settings"][k] == v for k, v in tuned.items())
        ]
        results["confirm"] = stage_confirm(args, min(on_tuned, key=_rank_key)["settings"])
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    plot(results, args.out / "tune.png")
    for stage in ("baseline", "kfac", "confirm"):
        if results.get(stage):
            print(format_rows(f"{stage} ({args.task})", results[stage]) + "\n", flush=True)
    print(f"wrote {path} and {args.out / 'tune.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
