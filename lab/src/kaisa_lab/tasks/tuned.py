"""The settings the benchmark suite selected for each task's arms, and nothing else.

A task's lr is *tuned* only where the suite's protocol selected it from runs
(:mod:`kaisa_lab.bench.protocol`, ``kaisa bench select CASE --write``): the
selections live in ``tuned.json`` beside this module, each with the number
of runs behind it, and a test re-derives every one of them from the
committed records. Everywhere else a task runs at its prior (the centre of
the suite's grid) and ``kaisa compare`` says the arm is not tuned.

Arms are named as the suite names them: ``adamw`` (first-order), ``adamw+kfac``
(K-FAC at the library's defaults, lr and warm-up tuned), ``adamw+kfac tuned``
(K-FAC's own knobs tuned too).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PATH", "SCHEMA", "Selection", "load", "selection", "write"]

#: the file the suite writes and the tasks read
PATH = Path(__file__).with_name("tuned.json")
SCHEMA = "kaisa-tuned/1"


@dataclass(frozen=True)
class Selection:
    """One arm's selected setting on one task, and what it was selected from."""

    lr: float
    warmup_epochs: float
    schedule: str
    kfac: Mapping[str, Any] = field(default_factory=dict)
    #: the suite's case, the settings it tried and the runs behind the choice
    case: str = ""
    settings: int = 0
    runs: int = 0


@functools.lru_cache(maxsize=1)
def load(path: Path = PATH) -> dict[str, dict[str, Selection]]:
    """Every selection, by task and arm (empty where the file is absent)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: expected schema {SCHEMA!r}; got {data.get('schema')!r}")
    return {
        task: {arm: Selection(**values) for arm, values in arms.items()}
        for task, arms in data["tasks"].items()
    }


def selection(task: str, arm: str) -> Selection | None:
    """The suite's selection for ``arm`` on ``task``, if it made one."""
    return load().get(task, {}).get(arm)


def write(selections: Mapping[str, Mapping[str, Selection]], path: Path = PATH) -> None:
    """Replace the selections of the tasks named (others kept) and rewrite the file."""
    current = {task: dict(arms) for task, arms in load(path).items()}
    current.update({task: dict(arms) for task, arms in selections.items()})
    body = {
        "schema": SCHEMA,
        "tasks": {
            task: {arm: _plain(s) for arm, s in sorted(arms.items())}
            for task, arms in sorted(current.items())
        },
    }
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    load.cache_clear()


def _plain(s: Selection) -> dict[str, Any]:
    return {
        "lr": s.lr,
        "warmup_epochs": s.warmup_epochs,
        "schedule": s.schedule,
        "kfac": dict(s.kfac),
        "case": s.case,
        "settings": s.settings,
        "runs": s.runs,
    }
