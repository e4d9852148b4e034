"""A campaign's records written without training: every run its protocol calls
for, in the order a worker would take them, with outcomes a test chooses.

For tests of what reads a campaign (reports, the forecast) that should not
depend on how far the committed campaigns have come."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kaisa_lab.bench.campaign import Campaign, Run
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.records import SCHEMA, RecordStore

__all__ = ["fill", "lr_bowl"]


def lr_bowl(campaign: Campaign, run: Run) -> int:
    """Steps to target: fewest at the arm's prior lr without warm-up, 20 more a
    grid step away, 10 more with the warm-up."""
    distance = abs(math.log2(run.setting.lr / campaign.case.prior_lr(run.arm.optimizer)))
    return int(100 + 20 * distance + (10 if run.setting.warmup_epochs else 0))


def _curve(crossing: float, every: int, step_s: float) -> tuple[int, list[dict[str, float]]]:
    """Evaluations every ``every`` steps of a loss falling on a straight line
    through the target (0.5) at step ``crossing``, up to the first at or under
    it: its step and the curve (each point's clock ``step_s`` a step)."""
    reached = every * math.ceil(crossing / every)
    points = [
        {"step": s, "metric": 0.5 + 0.01 * (crossing - s), "time_s": step_s * s}
        for s in range(every, reached + 1, every)
    ]
    return reached, points


def _record(
    case: str, run: Run, steps: float, group: str, step_s: float, every: int | None = None
) -> dict[str, Any]:
    curve: list[dict[str, float]] = []
    if every is not None:
        steps, curve = _curve(steps, every, step_s)
    seconds = step_s * steps
    return {
        "schema": SCHEMA,
        "kind": "train",
        "case": case,
        "arm": run.arm.kind,
        "role": run.role,
        "seed": run.seed,
        "key": run.key,
        "group": group,
        "lockstep": [run.key],
        "config": run.spec.to_dict(),
        "result": {
            "reached": True,
            "steps_to_target": steps,
            "time_to_target_s": seconds,
            "cpu_time_to_target_s": seconds,
            "steps": steps,
            "train_time_s": seconds,
            "final_metric": 0.5,
            "metric": "loss",
            "target": 0.5,
            "higher_is_better": False,
            "step_times": {"median_ms": 1e3 * step_s, "cpu_median_ms": 1e3 * step_s},
            "fingerprints": {"initial_weights": f"w{run.seed}", "data_order": f"d{run.seed}"},
        },
        "curve": curve,
        "environment": {},
    }


def fill(
    root: Path,
    case_name: str,
    steps: Callable[[Campaign, Run], float] = lr_bowl,
    step_s: Callable[[Run], float] = lambda run: 0.01,
    rounds: int | None = None,
    every: int | None = None,
) -> Campaign:
    """Write every record ``case_name``'s protocol calls for under ``root``, each
    run's steps to target from ``steps`` and its seconds a step from
    ``step_s``; the campaign, all its arms done (or, with ``rounds``, after
    that many rounds of the units the records call for). With ``every``, a
    run is evaluated every that many steps: ``steps`` gives where its loss
    crosses the target, its steps to target are the first evaluation at or
    past it, and its curve holds every evaluation up to there."""
    store = RecordStore(root)
    campaign = Campaign(get_case(case_name), store)
    done = 0
    while (rounds is None or done < rounds) and (units := campaign.units()):
        done += 1
        for unit in units:
            for run in unit.runs:
                record = _record(
                    case_name, run, steps(campaign, run), unit.name, step_s(run), every
                )
                store.write(record)
        campaign.refresh()
    return campaign
