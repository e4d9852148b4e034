"""``results.json`` and the summary table printed after a command.

``results.json`` is a list with one object per run (also for ``kaisa train``,
so one reader handles both commands). Its fields are a public format that
scripts and the plot read; add fields rather than renaming them.

With ``--seeds N`` a "run" is an arm (one optimizer, with or without K-FAC)
trained on N seeds. Its original fields still describe one real run, the one
on the first seed (``--seed``), so with N = 1 the file reads exactly as
before; ``seeds`` holds every seed's record (same fields, plus ``seed``) and
``summary`` their median and spread (:mod:`kaisa_lab.cli.summary`), and for every
arm after the first the ratio of its median time to target to the first
arm's (the baseline's), and the spread of the same ratio seed by seed.
Every arm's ``summary`` also gets its cost per step, its time against the
fastest arm without K-FAC and, on a K-FAC arm, the verdict against its own
base optimizer (:mod:`kaisa_lab.cli.verdict`), which the table prints.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kaisa_lab.cli.summary import Spread, paired_ratios, ratio_of_medians, summarize_seeds
from kaisa_lab.cli.train import RunResult
from kaisa_lab.cli.verdict import best_first_order, compare_arms, verdict_lines

__all__ = [
    "TIMING_NOTE",
    "arms_to_dicts",
    "format_environment",
    "format_seed_table",
    "format_table",
    "load_average",
    "run_to_dict",
    "seed_record",
    "write_results",
]

TIMING_NOTE = "Times count training only: every evaluation is excluded (clock paused)."


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none, e.g. Windows).

    Recorded at the start and the end of a command: on a shared machine other
    processes slow every arm, and a time is only read right beside the load.
    """
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def format_environment(environment: Mapping[str, Any]) -> str:
    """One line on where the times were measured: device, CPUs, threads, load."""
    text = f"Measured on {environment['device']}"
    if environment.get("cpu_count") is not None:
        text += f", {environment['cpu_count']} CPUs"
    text += f", {environment['threads']} torch thread(s)"
    load = environment.get("load_average_1min") or {}
    if load.get("start") is not None and load.get("end") is not None:
        text += (
            f", 1-minute load average {load['start']:.1f} at the start and "
            f"{load['end']:.1f} at the end (other processes slow every run)"
        )
    return text + "."


def _outcome(result: RunResult) -> dict[str, Any]:
    """Why a run stopped, the spread of its step times, and its fingerprints."""
    return {
        "stopped": result.stopped,
        "step_times": None if result.step_times is None else asdict(result.step_times),
        "fingerprints": {
            "initial_weights": result.initial_weights,
            "data_order": result.data_order,
        },
    }


def run_to_dict(result: RunResult, environment: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object of one run; ``environment`` (device, ranks, ...) joins its config."""
    spec = result.spec
    return {
        "name": spec.name,
        "optimizer": spec.optimizer,
        "kfac": spec.kfac,
        "task": spec.task,
        "target": spec.target,
        "metric_name": result.metric_name,
        "higher_is_better": result.higher_is_better,
        "time_to_target_s": result.time_to_target_s,
        "steps_to_target": result.steps_to_target,
        "epochs_to_target": result.epochs_to_target,
        "final_metric": result.final_metric,
        "wall_time_s": result.wall_time_s,
        **_outcome(result),
        "config": {**spec.to_dict(), **environment},
        "curve": [asdict(record) for record in result.curve],
    }


def seed_record(result: RunResult) -> dict[str, Any]:
    """What differs between the seeds of one arm: the seed, the outcomes and the curve."""
    return {
        "seed": result.spec.seed,
        "time_to_target_s": result.time_to_target_s,
        "steps_to_target": result.steps_to_target,
        "epochs_to_target": result.epochs_to_target,
        "final_metric": result.final_metric,
        "wall_time_s": result.wall_time_s,
        **_outcome(result),
        "curve": [asdict(record) for record in result.curve],
    }


def arms_to_dicts(
    arms: Sequence[Sequence[RunResult]], environment: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """One ``results.json`` object per arm (each arm: its runs in seed order).

    The first arm is the baseline the others' time to target is compared with;
    :func:`kaisa_lab.cli.verdict.compare_arms` adds each arm's step cost, its
    time against the fastest arm without K-FAC and, for a K-FAC arm, the
    verdict against its own base optimizer.
    """
    out: list[dict[str, Any]] = []
    for index, runs in enumerate(arms):
        arm = run_to_dict(runs[0], environment)
        arm["seeds"] = [seed_record(r) for r in runs]
        arm["summary"] = summarize_seeds(arm["seeds"], arm["higher_is_better"])
        if index > 0:
            baseline = out[0]
            arm["summary"]["baseline"] = baseline["name"]
            arm["summary"]["time_to_target_ratio"] = ratio_of_medians(
                arm["summary"]["time_to_target_s"]["median"],
                baseline["summary"]["time_to_target_s"]["median"],
            )
            ratios = paired_ratios(arm["seeds"], baseline["seeds"])
            arm["summary"]["time_to_target_ratio_per_seed"] = (
                {**Spread.of(ratios).to_dict(), "n_seeds": len(ratios)} if ratios else None
            )
        out.append(arm)
    compare_arms(out)
    return out


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf; a diverged run's loss is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_results(path: Path, runs: Sequence[Mapping[str, Any]]) -> None:
    """Write the runs as strict JSON (no NaN), creating the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(list(runs)), indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _columns(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``headers`` and ``rows`` as aligned lines: first column left, the others right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _title(first: Mapping[str, Any]) -> str:
    direction = ">=" if first["higher_is_better"] else "<="
    return f"{first['task']}: target {first['metric_name']} {direction} {first['target']:g}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio_columns(
    runs: Sequence[Mapping[str, Any]],
) -> tuple[list[str], list[list[str]]]:
    """Step cost and time ratios (to the first run, to the fastest first-order run)."""
    first, best = runs[0], best_first_order(runs)
    headers = ["ms/step", f"time vs {first['name']}"]
    cells = []
    for run in runs:
        cost = run["summary"].get("step_cost_s")
        row = [_fmt(None if cost is None else 1000.0 * cost["median"], ".0f")]
        row.append("1.00" if run is first else _ratio(run["summary"]["time_to_target_ratio"]))
        cells.append(row)
    if best is not None and best is not first:
        headers.append(f"time vs {best['name']}")
        for run, row in zip(runs, cells):
            row.append(_ratio(run["summary"]["time_vs_best_first_order"]["ratio"]))
    return headers, cells


def format_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table: one row per run, and a footer saying what the times measure.

    With several runs (from :func:`arms_to_dicts`), also each run's cost per
    step and its time to target against the first run and against the fastest
    run without K-FAC, then one verdict line per K-FAC run
    (:func:`kaisa_lab.cli.verdict.verdict_lines`).
    """
    if not runs:
        return "(no runs)"
    first = runs[0]
    headers = [
        "run",
        "steps to target",
        "time to target (s)",
        "epochs to target",
        f"final {first['metric_name']}",
        "train time (s)",
    ]
    rows = [
        [
            run["name"],
            _fmt(run["steps_to_target"], "d"),
            _fmt(run["time_to_target_s"], ".2f"),
            _fmt(run["epochs_to_target"], ".3g"),
            _fmt(run["final_metric"], ".4f"),
            _fmt(run["wall_time_s"], ".2f"),
        ]
        for run in runs
    ]
    compared = len(runs) > 1 and all("summary" in run for run in runs)
    if compared:
        extra_headers, extra = _ratio_columns(runs)
        headers[3:3] = extra_headers
        rows = [[*row[:3], *more, *row[3:]] for row, more in zip(rows, extra)]
    seed = first.get("config", {}).get("seed")
    out = [
        _title(first) + ("" if seed is None else f"; seed {seed}"),
        *_columns(headers, rows),
        "",
        *(verdict_lines(runs) if compared else []),
        TIMING_NOTE + " '-' = target not reached.",
    ]
    return "\n".join(out)


def _stat(value: float, spec: str) -> str:
    return "inf" if math.isinf(value) else format(value, spec)


def _spread(spread: Mapping[str, float], spec: str) -> str:
    """``median [min-max]``, plus ``IQR q1-q3`` when the quartiles are there.

    Missed targets are infinite: shown as ``inf``, or as ``not reached`` when
    every seed missed (the minimum is infinite too).
    """
    if math.isinf(spread["min"]) and math.isinf(spread["max"]) and spread["min"] > 0:
        return "not reached"
    text = f"{_stat(spread['median'], spec)} [{_stat(spread['min'], spec)}-"
    text += f"{_stat(spread['max'], spec)}]"
    if "q1" in spread:
        text += f" IQR {_stat(spread['q1'], spec)}-{_stat(spread['q3'], spec)}"
    return text


def format_seed_table(arms: Sequence[Mapping[str, Any]]) -> str:
    """The table of ``--seeds N`` (N > 1): median [min-max] per arm, and the ratio of medians.

    Reads the in-memory summaries, whose infinities (missed targets) are still
    floats; ``results.json`` stores them as null.
    """
    if not arms:
        return "(no runs)"
    first = arms[0]
    headers = (
        "run",
        "reached",
        "time to target (s)",
        "steps to target",
        "epochs to target",
        f"final {first['metric_name']}",
        "train time (s)",
    )
    rows = []
    for arm in arms:
        summary = arm["summary"]
        rows.append(
            (
                arm["name"],
                f"{summary['reached']}/{summary['n_seeds']}",
                _spread(summary["time_to_target_s"], ".2f"),
                _spread(summary["steps_to_target"], "g"),
                _spread(summary["epochs_to_target"], ".3g"),
                _spread(summary["final_metric"], ".4f"),
                _spread(summary["wall_time_s"], ".2f"),
            )
        )
    seeds = first["summary"]["seeds"]
    out = [f"{_title(first)}; seeds {seeds[0]}-{seeds[-1]}", *_columns(headers, rows), ""]
    for arm in arms[1:]:
        ratio = arm["summary"]["time_to_target_ratio"]
        shown = "n/a (a median did not reach the target)" if ratio is None else f"{ratio:.2f}"
        per_seed = arm["summary"].get("time_to_target_ratio_per_seed")
        if per_seed is not None:
            shown += (
                f"; per seed {per_seed['median']:.2f} [{per_seed['min']:.2f}-"
                f"{per_seed['max']:.2f}] (median [min-max] over the {per_seed['n_seeds']} "
                "seeds where both reached it)"
            )
        out.append(f"median time to target, {arm['name']} / {first['name']}: {shown}")
    out += [
        *verdict_lines(arms),
        TIMING_NOTE,
        "Cells: median [min-max] over seeds (IQR from 4 seeds); a run that misses the target "
        "counts as infinitely slow (inf), so a median is inf when the middle run(s) missed.",
    ]
    return "\n".join(out)
