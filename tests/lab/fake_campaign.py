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


def _record(case: str, run: Run, steps: int, group: str, step_s: float) -> dict[str, Any]:
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
            "step_times": {"median_ms": 1e3 * step_s, "cpu_median_ms": 1e3 * step_s},
            "fingerprints": {"initial_weights": f"w{run.seed}", "data_order": f"d{run.seed}"},
        },
        "curve": [],
        "environment": {},
    }


def fill(
    root: Path,
    case_name: str,
    steps: Callable[[Campaign, Run], int] = lr_bowl,
    step_s: Callable[[Run], float] = lambda run: 0.01,
    rounds: int | None = None,
) -> Campaign:
    """Write every record ``case_name``'s protocol calls for under ``root``, each
    run's steps to target from ``steps`` and its seconds a step from
    ``step_s``; the campaign, all its arms done (or, with ``rounds``, after
    that many rounds of the units the records call for)."""
    store = RecordStore(root)
    campaign = Campaign(get_case(case_name), store)
    done = 0
    while (rounds is None or done < rounds) and (units := campaign.units()):
        done += 1
        for unit in units:
            for run in unit.runs:
                store.write(_record(case_name, run, steps(campaign, run), unit.name, step_s(run)))
        campaign.refresh()
    return campaign
