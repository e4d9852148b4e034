"""The suite's cost cases: how a case is declared, measured, recorded and reported.

A *timing case* answers a question about cost (a step's time, its stages, the
bytes it moves, what the planner predicts) rather than time to a target. It
declares:

- ``measure(options)``: does the measuring and returns one :class:`Row` per
  arm (an arm is whatever the case compares: a model and a variant, a stage, a
  world size); arms that are timed against each other are timed with
  :func:`kaisa_lab.bench.timer.interleave`, never one after another;
- ``options`` (defaults) and ``quick`` (what ``make bench`` and the tests
  override, so the case runs in seconds);
- ``tables``: markdown renderers over the case's latest records, which the
  docs' generated regions call (``kaisa bench report CASE --table NAME``);
- ``plot``: a PNG of the same.

``kaisa bench run CASE`` measures and writes one record per row (schema of
:mod:`kaisa_lab.bench.records`, ``kind = "timing"``, all rows of one
measurement sharing its ``run`` stamp); the report reads the newest run.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kaisa_lab.bench.records import SCHEMA, RecordStore, config_key, environment, load_average

__all__ = [
    "TIMING_CASES",
    "Row",
    "TimingCase",
    "latest",
    "register",
    "run_timing",
]


@dataclass(frozen=True)
class Row:
    """One arm's measurement: what it is (``config``) and what was measured (``result``)."""

    arm: str
    config: Mapping[str, Any]
    result: Mapping[str, Any]


Records = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class TimingCase:
    """A cost question, its measurement and its renderings."""

    name: str
    description: str
    measure: Callable[[Mapping[str, Any]], list[Row]]
    options: Mapping[str, Any] = field(default_factory=dict)
    quick: Mapping[str, Any] = field(default_factory=dict)
    tables: Mapping[str, Callable[[Records], str]] = field(default_factory=dict)
    plot: Callable[[Records, Path], None] | None = None
    #: where it measures: "cpu", "cuda" (needs a GPU), or "any" (the --device given)
    device: str = "cpu"
    #: whether ``make bench`` runs it (with its ``quick`` options)
    in_make_bench: bool = True
    #: the ``result`` fields a re-run reproduces exactly, on any machine and under
    #: any load (plans, bytes, memory, modelled times; never timings): the tests
    #: compare them with the committed records, so docs rendered from those
    #: records cannot go stale
    deterministic: tuple[str, ...] = ()

    def resolve(self, given: Mapping[str, Any], quick: bool) -> dict[str, Any]:
        """The options of a run: defaults, then ``quick``'s (if asked), then ``given``."""
        unknown = set(given) - set(self.options)
        if unknown:
            raise KeyError(
                f"case {self.name} has no option {', '.join(sorted(unknown))}; "
                f"its options: {', '.join(sorted(self.options)) or 'none'}"
            )
        for key, value in given.items():
            problem = _option_problem(key, value, self.options[key])
            if problem:
                raise KeyError(f"case {self.name}'s option {key}: {problem}; got {value!r}")
        return {**self.options, **(self.quick if quick else {}), **given}


#: integer options that may be 0 (every other integer option counts something
#: that must happen at least once: rounds, blocks, steps, a batch)
_MAY_BE_ZERO = frozenset({"warmup"})


def _option_problem(key: str, value: Any, default: Any) -> str:
    """Why ``value`` cannot stand for an option whose default is ``default``
    ('' when it can): the same kind as the default (an option whose default
    is None takes any value), counts positive, numbers finite and >= 0; so a
    bad value is refused before the measurement starts, not deep inside it."""
    if default is None:
        return ""
    if isinstance(default, bool):
        return "" if isinstance(value, bool) else "expected true or false"
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            return "expected an integer"
        least = 0 if key in _MAY_BE_ZERO else 1
        return "" if value >= least else f"expected an integer >= {least}"
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "expected a number"
        return "" if math.isfinite(value) and value >= 0 else "expected a finite number >= 0"
    if isinstance(default, dict):  # keywords: a JSON object or the case's KEY=VALUE text
        return "" if isinstance(value, (dict, str)) else "expected a JSON object"
    if isinstance(default, str):  # a path or a name: null turns it off (reference_src)
        return "" if value is None or isinstance(value, str) else "expected a text or null"
    if isinstance(default, list) and not isinstance(value, list):
        return "expected a JSON list"
    return ""


#: every timing case, by name (filled by :func:`register`)
TIMING_CASES: dict[str, TimingCase] = {}


def register(case: TimingCase) -> TimingCase:
    if case.name in TIMING_CASES:
        raise ValueError(f"timing case {case.name!r} is declared twice")
    TIMING_CASES[case.name] = case
    return case


def run_timing(
    case: TimingCase,
    options: Mapping[str, Any],
    store: RecordStore,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Measure ``case`` with ``options`` and write one record per row; return them."""
    load_start = load_average()
    rows = case.measure(options)
    env = environment(device, load_start, load_average())
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    records = []
    for row in rows:
        config = {**row.config, "options": dict(options)}
        record = {
            "schema": SCHEMA,
            "kind": "timing",
            "case": case.name,
            "arm": row.arm,
            "role": "timing",
            "seed": 0,
            "run": stamp,
            "key": config_key(config),
            "config": config,
            "result": dict(row.result),
            "environment": env,
        }
        store.write(record)
        records.append(record)
    return records


def latest(store: RecordStore, case: str) -> list[dict[str, Any]]:
    """The records of the newest measurement of ``case`` (every arm of that run)."""
    records = [r for r in store.read(case) if r.get("kind") == "timing"]
    if not records:
        return []
    newest = max(r["run"] for r in records)
    return [r for r in records if r["run"] == newest]
