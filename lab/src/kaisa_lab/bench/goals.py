"""The bar kaisa sets itself against the optimizers its users pick today,
checked from the suite's records.

kaisa is worth its two lines only where it reaches a target sooner than the
best optimizer a user could tune instead, so the bar is stated against the
*best tuned peer*: the fastest first-order arm of a case (AdamW, Muon, SOAP,
Shampoo, LAMB, whichever the case runs), every arm tuned by the same
protocol and compared on the held-out seeds. In numbers:

- **time at batch 32**: kaisa's best arm (the fastest K-FAC arm of the case,
  whatever its base optimizer or lever) reaches the target in ≤ 0.85× the
  best peer's time, on each language-model family;
- **steps at batch 512**: its steps ≤ 0.7× the best peer's (``text-lm-b512``),
  and **time on 64 ranks**: its forecast time ≤ 0.8× the best peer's at a
  per-rank batch of 8 (``large-batch-forecast``, in each layout);
- **a step's cost**: a K-FAC step, factor steps and decompositions
  amortised at the library's intervals, ≤ 1.0× a Muon step on the CPU clock
  (``levers-step-cost``: its cheapest K-FAC arm on any base optimizer, the
  cheapest on Muon itself beside it);
- **the defaults on AdamW**: K-FAC at the library's defaults on AdamW ≤ 0.75×
  tuned AdamW's time, on every language-model family.

Each :class:`Check` reads *met*, *missed* or why it cannot be read yet, next
to the figures that say why: behind a time, the steps and the time a step,
each a paired ratio like every ratio of the reports
(:func:`~kaisa_lab.bench.rows.paired_ratio`), and the steps and the time read
between evaluations (:func:`~kaisa_lab.bench.rows.steps_between`): where a
run is evaluated every 20 steps and reaches its target near 60 or 140, the
measured ratio moves in jumps larger than the effects it weighs, and the
reading between evaluations says which way the jump hid. The verdict is the
measured ratio's. Nothing is typed in: a case still being measured reads as
such.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.report import arm_label
from kaisa_lab.bench.rows import (
    ArmRow,
    complete_rows,
    paired_ratio,
    quotient,
    steps_between,
    steps_to_target,
    time_between,
    time_per_step,
    time_to_target,
    trained_apart,
)
from kaisa_lab.bench.timing import latest

__all__ = [
    "LARGE_BATCH",
    "LEVER_FAMILIES",
    "LM_FAMILIES",
    "Check",
    "checks",
    "defaults_check",
    "forecast_checks",
    "markdown_goals",
    "step_cost_checks",
    "steps_check",
    "time_check",
]

#: the language-model families at batch 32, each with every peer
LM_FAMILIES = ("text-lm", "text-cnn", "text-lm-large")
#: the levers cases: the same families with their levers, Muon their only peer
LEVER_FAMILIES = ("text-lm-levers", "text-cnn-levers")
#: the large-batch study's batch-512 case
LARGE_BATCH = "text-lm-b512"

#: the bar's limits, each a ratio to the best peer's (Muon's for the step)
TIME_AT_32 = 0.85
STEPS_AT_512 = 0.7
TIME_ON_64 = 0.8
STEP_COST = 1.0
DEFAULTS_ON_ADAMW = 0.75


@dataclass(frozen=True)
class Check:
    """One claim of the bar, as the records read it."""

    bar: str  # the claim, ``time ≤ 0.85× the best peer``
    where: str  # the case (and batch) it is read on
    limit: float
    compared: str = ""  # ``muon + K-FAC (tuned) / muon``
    ratio: float | None = None  # None: cannot be read (``pending`` says why)
    why: str = ""  # the figures behind the ratio
    pending: str = "not measured yet"

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return self.pending
        return "met" if self.ratio <= self.limit else "missed"


def _ratio_text(ratio: float | None, limit: float | None = None) -> str:
    """A ratio as a cell: ``0.83×`` (three decimals where two would round it
    onto ``limit``, which it is read against), or what a miss on either side
    reads as."""
    if ratio is None:
        return "-"
    if math.isnan(ratio):
        return "neither reaches"
    if math.isinf(ratio):
        return "misses the target"
    if ratio == 0.0:
        return "the peer misses"
    if limit is not None and round(ratio, 2) == limit and ratio != limit:
        return f"{ratio:.3f}×"
    return f"{ratio:.2f}×"


def _label(row: ArmRow) -> str:
    return arm_label(row.arm)


def _where(campaign: Campaign) -> str:
    return f"`{campaign.case.name}` (batch {campaign.case.global_batch})"


def _median_steps(row: ArmRow) -> float:
    """Median steps to target over every held-out seed, a miss counting as infinitely many."""
    return statistics.median(steps_to_target(r) for r in row.records)


def _pair(row: ArmRow, peer: ArmRow, bar: str, where: str, limit: float, steps: bool) -> Check:
    """``row`` against ``peer``: their times (or steps) paired by seed, and the
    steps and time a step behind them."""
    ratio = paired_ratio(row, peer, steps_to_target if steps else time_to_target)
    why = [
        f"steps {_ratio_text(paired_ratio(row, peer, steps_to_target))} "
        f"({_ratio_text(paired_ratio(row, peer, steps_between))} between evaluations)"
    ]
    if not steps:
        why.append(f"time a step {_ratio_text(paired_ratio(row, peer, time_per_step))}")
        why.append(f"time {_ratio_text(paired_ratio(row, peer, time_between))} between evaluations")
    pending = "trained apart" if trained_apart(row, peer) else "not measured yet"
    return Check(
        bar,
        where,
        limit,
        compared=f"{_label(row)} / {_label(peer)}",
        ratio=ratio,
        why=", ".join(why),
        pending=pending,
    )


def _split(campaign: Campaign, levers: bool = True) -> tuple[list[ArmRow], list[ArmRow]] | None:
    """The K-FAC arms' and the peers' held-out rows, or None while any arm is
    still being measured (:func:`~kaisa_lab.bench.rows.complete_rows`)."""
    rows = complete_rows(campaign, levers)
    if rows is None:
        return None
    kfac = [r for r in rows if r.arm.kfac]
    peers = [r for r in rows if not r.arm.kfac]
    return (kfac, peers) if kfac and peers else None


def _best_of_each(campaign: Campaign, bar: str, limit: float, steps: bool) -> Check:
    """The best K-FAC arm of the case against its best peer: fastest (or with
    the fewest ``steps``) by the median over the held-out seeds."""
    split = _split(campaign)
    if split is None:
        return Check(bar, _where(campaign), limit)
    key: Callable[[ArmRow], float] = _median_steps if steps else (lambda r: r.median_time_s)
    kfac, peers = split
    return _pair(min(kfac, key=key), min(peers, key=key), bar, _where(campaign), limit, steps)


def time_check(campaign: Campaign, limit: float = TIME_AT_32) -> Check:
    """The fastest K-FAC arm of the case against its fastest peer, by time to target."""
    return _best_of_each(campaign, f"time ≤ {limit:g}× the best peer", limit, steps=False)


def steps_check(campaign: Campaign, limit: float = STEPS_AT_512) -> Check:
    """The K-FAC arm with the fewest steps against the peer with the fewest."""
    return _best_of_each(campaign, f"steps ≤ {limit:g}× the best peer's", limit, steps=True)


def defaults_check(campaign: Campaign, limit: float = DEFAULTS_ON_ADAMW) -> Check:
    """K-FAC at the library's defaults on AdamW against tuned AdamW."""
    bar = f"defaults on AdamW ≤ {limit:g}× tuned AdamW"
    split = _split(campaign, levers=False)
    base = defaults = None
    if split is not None:
        kfac, peers = split
        base = next((r for r in peers if r.arm.optimizer == "adamw"), None)
        defaults = next((r for r in kfac if r.arm.optimizer == "adamw" and not r.arm.knobs), None)
    if base is None or defaults is None:
        return Check(bar, _where(campaign), limit)
    return _pair(defaults, base, bar, _where(campaign), limit, steps=False)


def forecast_checks(
    records: Sequence[Mapping[str, Any]],
    batch: int = 512,
    world: int = 64,
    limit: float = TIME_ON_64,
) -> list[Check]:
    """Per layout, the K-FAC arm forecast fastest on ``world`` ranks at global
    ``batch`` against the first-order arm forecast fastest (records of
    ``large-batch-forecast``); behind it, the held-out steps and a rank's
    step in that layout."""
    from kaisa_lab.bench.costs.scaling import LAYOUTS, rank_ms

    bar = f"time on {world} ranks ≤ {limit:g}× the best peer's"
    mine = [r for r in records if r["config"]["batch"] == batch and r["config"]["world"] == world]
    where = f"`large-batch-forecast` (batch {batch}, {world} ranks, %s)"
    ready = bool(mine) and all(
        r["result"]["measured"] and r["result"].get("steps") is not None for r in mine
    )
    checks = []
    for layout in LAYOUTS:
        if not ready:
            checks.append(Check(bar, where % layout, limit, pending="not forecast yet"))
            continue

        def forecast(r: Mapping[str, Any], layout: str = layout) -> float:
            value = r["result"]["layouts"][layout]["forecast_s"]
            return math.inf if value is None else float(value)

        kfac = [r for r in mine if "+kfac" in r["config"]["arm"]]
        peers = [r for r in mine if "+kfac" not in r["config"]["arm"]]
        best, peer = min(kfac, key=forecast), min(peers, key=forecast)
        plans = [r["result"]["layouts"][layout] for r in (best, peer)]
        ranks = [rank_ms(p) for p in plans]
        steps = [float(r["result"]["steps"]) for r in (best, peer)]
        checks.append(
            Check(
                bar,
                where % layout,
                limit,
                compared=f"{best['config']['arm']} / {peer['config']['arm']}",
                ratio=quotient(forecast(best), forecast(peer)),
                why=f"steps {_ratio_text(quotient(*steps))}, "
                f"a rank's step {_ratio_text(quotient(*ranks))}",
            )
        )
    return checks


def step_cost_checks(
    records: Sequence[Mapping[str, Any]], base: str = "muon", limit: float = STEP_COST
) -> list[Check]:
    """Per task, the cheapest K-FAC arm (on any base optimizer) against ``base``
    alone, by CPU time per step (records of ``levers-step-cost``: every arm
    interleaved, factor steps and decompositions amortised); behind it, the
    cheapest K-FAC arm on ``base`` itself and K-FAC at the library's defaults
    on it — a cheap step on a base that needs more steps is not a cheap
    ``base`` + K-FAC."""
    bar = f"a K-FAC step ≤ {limit:g}× a {base.capitalize()} step (CPU)"
    tasks = list(dict.fromkeys(r["config"]["task"] for r in records))
    if not tasks:
        return [Check(bar, "`levers-step-cost`", limit, pending="not timed yet")]
    checks = []
    for task in tasks:
        cpu = {
            r["config"]["arm"]: float(r["result"]["cpu_ms"])
            for r in records
            if r["config"]["task"] == task and r["result"].get("cpu_ms") is not None
        }
        where = f"`levers-step-cost` ({task})"
        kfac = {arm: ms / cpu[base] for arm, ms in cpu.items() if "+kfac" in arm and base in cpu}
        if not kfac:
            checks.append(Check(bar, where, limit, pending="not timed yet"))
            continue
        cheapest = min(kfac, key=kfac.__getitem__)
        on_base = {arm: v for arm, v in kfac.items() if arm.startswith(f"{base}+kfac")}
        why = []
        if on_base and cheapest not in on_base:
            own = min(on_base, key=on_base.__getitem__)
            why.append(f"on {base}: {own} {_ratio_text(on_base[own], limit)}")
        if f"{base}+kfac" in kfac:
            why.append(f"{base}+kfac (the defaults) {_ratio_text(kfac[f'{base}+kfac'], limit)}")
        checks.append(
            Check(
                bar,
                where,
                limit,
                compared=f"{cheapest} / {base}",
                ratio=kfac[cheapest],
                why=", ".join(why),
            )
        )
    return checks


def markdown_goals(checks: Sequence[Check]) -> str:
    """The checks as a table: the claim, where it is read, which arms, the
    measured ratio, the verdict and the figures behind it."""
    lines = [
        "| the bar | read on | compared | measured | verdict | behind it |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c.bar} | {c.where} | {c.compared or '-'} | {_ratio_text(c.ratio, c.limit)} "
            f"| {c.verdict} | {c.why or '-'} |"
        )
    return "\n".join(lines) + "\n"


def checks(store: RecordStore) -> list[Check]:
    """Every check of the bar, read from the records under ``store``."""
    names = (*LM_FAMILIES, *LEVER_FAMILIES, LARGE_BATCH)
    campaigns = {name: Campaign(get_case(name), store) for name in names}
    return [
        *(time_check(campaigns[n]) for n in (*LM_FAMILIES, *LEVER_FAMILIES)),
        steps_check(campaigns[LARGE_BATCH]),
        *forecast_checks(latest(store, "large-batch-forecast")),
        *step_cost_checks(latest(store, "levers-step-cost")),
        *(defaults_check(campaigns[n]) for n in LM_FAMILIES),
    ]
