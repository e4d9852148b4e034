"""``results.json`` and the summary table printed after a command.

``results.json`` is a list with one object per run (also for ``kaisa train``,
so one reader handles both commands). Its fields are a public format that
scripts and the plot read; add fields rather than renaming them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kaisa.cli.train import RunResult

__all__ = ["TIMING_NOTE", "format_table", "run_to_dict", "write_results"]

TIMING_NOTE = (
    "Times count training only: evaluation at the end of each epoch is excluded (clock paused)."
)


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
        "config": {**spec.to_dict(), **environment},
        "curve": [asdict(record) for record in result.curve],
    }


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


def format_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table: one row per run, and a footer saying what the times measure."""
    if not runs:
        return "(no runs)"
    first = runs[0]
    direction = ">=" if first["higher_is_better"] else "<="
    headers = (
        "run",
        f"final {first['metric_name']}",
        "time to target (s)",
        "steps to target",
        "epochs to target",
        "train time (s)",
    )
    rows = [
        (
            run["name"],
            _fmt(run["final_metric"], ".4f"),
            _fmt(run["time_to_target_s"], ".2f"),
            _fmt(run["steps_to_target"], "d"),
            _fmt(run["epochs_to_target"], "d"),
            _fmt(run["wall_time_s"], ".2f"),
        )
        for run in runs
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    out = [
        f"{first['task']}: target {first['metric_name']} {direction} {first['target']:g}",
        line(headers),
        line(["-" * w for w in widths]),
        *(line(r) for r in rows),
        "",
        TIMING_NOTE + " '-' = target not reached.",
    ]
    return "\n".join(out)
