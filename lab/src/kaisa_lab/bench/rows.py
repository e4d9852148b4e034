"""What a case's held-out records say of each arm, and how two arms compare.

A row (:class:`ArmRow`) is one arm's held-out figures: its selected
setting's runs on the held-out seeds, their steps and times to target on
the runs' own clocks, the step's cost. Two rows compare by a *paired* ratio
(:func:`paired_ratio`): per seed, one arm's value over the other's, then the
median, because the arms of one seed stepped in one lockstep group under
one load while seeds ran hours apart. Before a row is built every arm of a
seed is checked to have started from the same weights and data order
(:func:`check_fairness`). The tables (:mod:`kaisa_lab.bench.report`), the
figures (:mod:`kaisa_lab.bench.plots`), the advice, the goals and the
defaults' decisions all read these rows; none reads a record another way.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import Arm

__all__ = [
    "WALL_CLOCK",
    "ArmRow",
    "FairnessError",
    "check_fairness",
    "complete_rows",
    "cpu_step_ms",
    "cpu_time_to_target",
    "evaluated_every",
    "heldout_rows",
    "lever_pairs",
    "lever_ratios",
    "paired_ratio",
    "quotient",
    "side_by_side",
    "step_ms",
    "steps_between",
    "steps_to_target",
    "time_between",
    "time_per_step",
    "time_to_target",
    "trained_apart",
]


class FairnessError(ValueError):
    """Arms of one held-out seed did not start from the same weights or data order."""


@dataclass(frozen=True)
class ArmRow:
    """One arm's held-out figures (None where no seed reached the target)."""

    arm: Arm
    setting: str
    seeds: int
    reached: int
    steps: tuple[float, float, float] | None  # median, min, max over the reaching seeds
    time_s: tuple[float, float, float] | None
    median_time_s: float  # over every seed, a miss counting as infinity
    step_ms: float | None
    records: tuple[Mapping[str, Any], ...]
    #: the median step's CPU time (ms), where every record has one (CPU runs
    #: recorded with the CPU clock): the step's cost without the machine's load
    cpu_ms: float | None = None
    #: the median time to target on the CPU clock (a miss: infinity), where
    #: every reaching record has it
    cpu_time_s: float | None = None


def _spread(values: Sequence[float]) -> tuple[float, float, float] | None:
    return (statistics.median(values), min(values), max(values)) if values else None


def time_to_target(record: Mapping[str, Any]) -> float:
    """A run's time to target on the wall clock; a miss is infinitely slow."""
    result = record["result"]
    return float(result["time_to_target_s"]) if result["reached"] else math.inf


def cpu_time_to_target(record: Mapping[str, Any]) -> float | None:
    """A run's time to target on the CPU clock (a miss: infinity); None where not recorded."""
    result = record["result"]
    if not result["reached"]:
        return math.inf
    value = result.get("cpu_time_to_target_s")
    return None if value is None else float(value)


def steps_to_target(record: Mapping[str, Any]) -> float:
    result = record["result"]
    return float(result["steps_to_target"]) if result["reached"] else math.inf


def step_ms(record: Mapping[str, Any]) -> float | None:
    value = (record["result"].get("step_times") or {}).get("median_ms")
    return None if value is None else float(value)


def cpu_step_ms(record: Mapping[str, Any]) -> float | None:
    value = (record["result"].get("step_times") or {}).get("cpu_median_ms")
    return None if value is None else float(value)


def time_per_step(record: Mapping[str, Any]) -> float | None:
    """A run's wall time over its steps (s): every step it took, factor steps
    and decompositions amortised as training pays them (a step's median,
    :func:`step_ms`, is a plain step's). Whether or not it reached the target."""
    result = record["result"]
    steps = result.get("steps")
    return float(result["train_time_s"]) / steps if steps else None


def _crossing(record: Mapping[str, Any], field: str) -> float:
    """Where a run's curve crosses its target, ``field`` (``step`` or
    ``time_s``) read by linear interpolation between the last evaluation
    that missed the target and the first that reached it (a miss: infinity).
    Reached at the first evaluation, there is nothing before it to read
    from: that evaluation's value. A record without a curve: its figure at
    the evaluation."""
    result = record["result"]
    if not result["reached"]:
        return math.inf
    at_evaluation = {"step": steps_to_target, "time_s": time_to_target}[field]
    curve = record.get("curve")
    if not curve:
        return at_evaluation(record)
    target, higher = float(result["target"]), bool(result["higher_is_better"])
    before: Mapping[str, Any] | None = None
    for point in curve:
        metric = float(point["metric"])
        if metric >= target if higher else metric <= target:
            if before is None:
                return float(point[field])
            share = (float(before["metric"]) - target) / (float(before["metric"]) - metric)
            return float(before[field]) + share * (float(point[field]) - float(before[field]))
        before = point
    return at_evaluation(record)


def steps_between(record: Mapping[str, Any]) -> float:
    """A run's steps to target read between evaluations (:func:`_crossing`).

    Why: a run is evaluated every few steps, so its steps to target are a
    multiple of that interval, and two arms whose true crossings lie within
    one interval read alike — at 140 steps read every 20, a ratio moves in
    jumps of 14%, more than the effects measured. The metric's straight line
    between the two evaluations around the crossing places it within the
    interval; an estimate from the run's own curve, reported beside the
    measured figure, never in its place."""
    return _crossing(record, "step")


def time_between(record: Mapping[str, Any]) -> float:
    """A run's time to target read between evaluations: its clock at the
    crossing :func:`steps_between` places (the clock interpolated between the
    two evaluations' readings, evaluation itself off the clock as always)."""
    return _crossing(record, "time_s")


def evaluated_every(records: Sequence[Mapping[str, Any]]) -> int | None:
    """The steps between two evaluations of the runs (the median gap of their
    curves; None without a curve of two points)."""
    gaps = [
        b["step"] - a["step"]
        for record in records
        for a, b in itertools.pairwise(record.get("curve") or ())
    ]
    return int(statistics.median(gaps)) if gaps else None


def side_by_side(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two runs stepped in one lockstep group, under one load: their
    records name the same group (:func:`kaisa_lab.bench.campaign.run_unit`
    keeps the name through a resume). Two records from before a record
    listed its group's runs (no ``lockstep``) are taken at their seed's word,
    as the reports always took them (their group names were each run's own
    finish); one from before and one since never shared a group."""
    if "lockstep" not in a and "lockstep" not in b:
        return True
    return bool(a.get("group") == b.get("group"))


#: what a run's wall clock measures: its ratio to another run's means something
#: only where the two shared the machine's load (:func:`side_by_side`)
WALL_CLOCK = (time_to_target, step_ms, time_per_step, time_between)


def _seed_pairs(row: ArmRow, ref: ArmRow) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """The two arms' records of each seed both ran."""
    theirs = {r["seed"]: r for r in ref.records}
    return [(r, theirs[r["seed"]]) for r in row.records if r["seed"] in theirs]


def trained_apart(row: ArmRow, ref: ArmRow) -> bool:
    """Whether every seed the two arms share was trained in groups apart (an
    arm held out after the others): their wall clocks do not pair."""
    pairs = _seed_pairs(row, ref)
    return bool(pairs) and not any(side_by_side(a, b) for a, b in pairs)


def paired_ratio(
    row: ArmRow, ref: ArmRow, value: Callable[[Mapping[str, Any]], float | None] = time_to_target
) -> float | None:
    """The median over the seeds both arms ran of ``row``'s value over ``ref``'s on that seed.

    Why paired: every arm of a held-out seed steps in one lockstep group, so
    the machine's load during that group falls on both alike, while seeds'
    groups run hours apart under loads of their own. A ratio of the two
    medians keeps that spread (one arm's median may come from a busy hour,
    the other's from a quiet one); the ratio per seed cancels it. A seed
    that only ``row`` misses reads as infinity, one that only ``ref``
    misses as 0 (:func:`quotient`), one both miss carries no ratio and is
    left out (NaN where no seed is left). None where a seed lacks the value
    (records from before that clock was kept) or the arms share no seed. A
    wall-clock value pairs only runs that stepped side by side
    (:func:`side_by_side`); steps and CPU times pair by seed alone.
    """
    records = _seed_pairs(row, ref)
    if value in WALL_CLOCK:
        records = [(a, b) for a, b in records if side_by_side(a, b)]
    pairs = [(value(a), value(b)) for a, b in records]
    if not pairs or any(a is None or b is None for a, b in pairs):
        return None
    ratios = [quotient(cast(float, a), cast(float, b)) for a, b in pairs]
    ratios = [q for q in ratios if not math.isnan(q)]
    return statistics.median(ratios) if ratios else math.nan


def heldout_rows(campaign: Campaign) -> list[ArmRow]:
    """The held-out figures of every selected arm (arms not yet held out are left out)."""
    seeds = campaign.protocol.heldout_seeds
    rows = []
    for arm in campaign.case.arms:
        state = campaign.state(arm)
        if state.selected is None:
            continue
        records = campaign.records(arm, state.selected, seeds)
        if not records:
            continue
        results = [r["result"] for r in records]
        reached = [r for r in results if r["reached"]]
        times = [time_to_target(r) for r in records]
        costs = [c for c in map(step_ms, records) if c is not None]
        cpu = [cpu_step_ms(r) for r in records]
        cpu_times = [cpu_time_to_target(r) for r in records]
        rows.append(
            ArmRow(
                arm=arm,
                setting=state.selected.describe(),
                seeds=len(results),
                reached=len(reached),
                steps=_spread([float(r["steps_to_target"]) for r in reached]),
                time_s=_spread([r["time_to_target_s"] for r in reached]),
                median_time_s=statistics.median(times),
                step_ms=statistics.median(costs) if costs else None,
                records=tuple(records),
                cpu_ms=None if None in cpu else statistics.median(cast(list[float], cpu)),
                cpu_time_s=None
                if None in cpu_times
                else statistics.median(cast(list[float], cpu_times)),
            )
        )
    check_fairness(rows)
    return rows


def complete_rows(campaign: Campaign, levers: bool = True) -> list[ArmRow] | None:
    """Every arm's held-out row (without ``levers``: every arm but the lever
    arms), or None while one of them is not selected or lacks a record of a
    held-out seed: a figure over the seeds that happen to be done is not the
    comparison the protocol defines."""
    rows = [r for r in heldout_rows(campaign) if levers or not r.arm.lever]
    read = [a for a in campaign.case.arms if levers or not a.lever]
    held_out = len(campaign.protocol.heldout_seeds)
    if len(rows) < len(read) or any(r.seeds < held_out for r in rows):
        return None
    return rows


def check_fairness(rows: Sequence[ArmRow]) -> None:
    """Raise :class:`FairnessError` unless every arm of a seed shares its fingerprints."""
    by_seed: dict[int, set[tuple[str, str]]] = {}
    for row in rows:
        for record in row.records:
            prints = record["result"]["fingerprints"]
            by_seed.setdefault(record["seed"], set()).add(
                (prints["initial_weights"], prints["data_order"])
            )
    for seed, prints in sorted(by_seed.items()):
        if len(prints) > 1:
            raise FairnessError(
                f"held-out seed {seed}: the arms started from {len(prints)} different "
                "weight/data-order fingerprints; a comparison needs one"
            )


def quotient(a: float, b: float) -> float:
    """``a / b`` for times or steps where a miss is infinite: both missing is
    no ratio (NaN), only ``b`` missing is 0 (``a`` wins outright)."""
    if math.isinf(a) and math.isinf(b):
        return math.nan
    if math.isinf(b):
        return 0.0 if math.isfinite(a) else math.nan
    return a / b if b > 0 else math.nan


def lever_pairs(rows: Sequence[ArmRow]) -> list[tuple[ArmRow, ArmRow | None]]:
    """Each lever arm's row with that of K-FAC at the library's defaults on the
    same base optimizer (None while that one is not held out)."""
    plain = {r.arm.optimizer: r for r in rows if r.arm.kfac and not r.arm.tag and not r.arm.knobs}
    return [(r, plain.get(r.arm.optimizer)) for r in rows if r.arm.tag]


def lever_ratios(
    campaigns: Sequence[Campaign],
) -> tuple[dict[str, dict[str, float]], set[tuple[str, str]]]:
    """Each lever's time to target over K-FAC's at the defaults on the same
    base, paired by seed: ``{lever kind: {case name: ratio}}`` (every lever arm
    of the cases a key, an empty mapping while none is held out), and the
    ``(kind, case)`` pairs whose two arms were held out apart (their wall
    clocks do not pair)."""
    ratios: dict[str, dict[str, float]] = {}
    apart: set[tuple[str, str]] = set()
    for campaign in campaigns:
        for arm in campaign.case.arms:
            if arm.tag:
                ratios.setdefault(arm.kind, {})
        for row, ref in lever_pairs(heldout_rows(campaign)):
            ratio = None if ref is None else paired_ratio(row, ref)
            if ratio is not None:
                ratios[row.arm.kind][campaign.case.name] = ratio
            elif ref is not None and trained_apart(row, ref):
                apart.add((row.arm.kind, campaign.case.name))
    return ratios, apart
