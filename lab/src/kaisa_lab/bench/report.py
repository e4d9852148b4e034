"""Tables of a case, computed from its records only (its figures:
:mod:`kaisa_lab.bench.plots`, from the same rows).

The time-to-target tables:

- ``heldout``: the reported comparison. Per arm, its selected setting and,
  over the held-out seeds, the median [min–max] steps and time to target on
  the runs' own clocks, how many seeds reached it, the median step cost, and
  its time against the best first-order arm's and (for a K-FAC arm) its base
  optimizer's, as a paired ratio (:func:`paired_ratio`: the median over the
  held-out seeds of the two arms' ratio on each seed, whose runs shared a
  lockstep group and so the machine's load). Before anything is computed
  the report checks that every arm started each held-out seed from the same
  weights and data order (the records' fingerprints); a mismatch is an
  error, not a row.
- ``tuning``: every setting each arm tried, with its median steps and time
  over the selection seeds (and, for a setting that changes a step's work,
  its cost pair's step cost), the selected one marked;
- ``selection``: each arm's selected setting beside the one its clock
  would have picked.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import Arm
from kaisa_lab.bench.protocol import Outcome, fastest, work_base

__all__ = [
    "TIE",
    "ArmRow",
    "FairnessError",
    "across_cell",
    "arm_label",
    "complete_rows",
    "heldout_rows",
    "lever_pairs",
    "lever_ratios",
    "lever_verdict",
    "lever_word",
    "markdown_heldout",
    "markdown_levers",
    "markdown_levers_across",
    "markdown_machine",
    "markdown_selection",
    "markdown_summary",
    "markdown_tuning",
    "paired_ratio",
    "quotient",
    "side_by_side",
    "steps_to_target",
    "time_cell",
    "time_per_step",
    "time_to_target",
    "trained_apart",
    "verdict",
    "with_measuring",
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


def _cpu_time(record: Mapping[str, Any]) -> float | None:
    """A run's time to target on the CPU clock (a miss: infinity); None where not recorded."""
    result = record["result"]
    if not result["reached"]:
        return math.inf
    value = result.get("cpu_time_to_target_s")
    return None if value is None else float(value)


def steps_to_target(record: Mapping[str, Any]) -> float:
    result = record["result"]
    return float(result["steps_to_target"]) if result["reached"] else math.inf


def _step_ms(record: Mapping[str, Any]) -> float | None:
    value = (record["result"].get("step_times") or {}).get("median_ms")
    return None if value is None else float(value)


def _cpu_ms(record: Mapping[str, Any]) -> float | None:
    value = (record["result"].get("step_times") or {}).get("cpu_median_ms")
    return None if value is None else float(value)


def time_per_step(record: Mapping[str, Any]) -> float | None:
    """A run's wall time over its steps (s): every step it took, factor steps
    and decompositions amortised as training pays them (a step's median,
    :func:`_step_ms`, is a plain step's). Whether or not it reached the target."""
    result = record["result"]
    steps = result.get("steps")
    return float(result["train_time_s"]) / steps if steps else None


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
_WALL_CLOCK = (time_to_target, _step_ms, time_per_step)


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
    if value in _WALL_CLOCK:
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
        costs = [c for c in map(_step_ms, records) if c is not None]
        cpu = [_cpu_ms(r) for r in records]
        cpu_times = [_cpu_time(r) for r in records]
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


def _fmt(spread: tuple[float, float, float] | None, spec: str) -> str:
    if spread is None:
        return "not reached"
    med, lo, hi = spread
    return f"{med:{spec}} [{lo:{spec}}–{hi:{spec}}]"


def arm_label(arm: Arm) -> str:
    """An arm's name in a table: unique within its case (a lever's tag included)."""
    if not arm.kfac:
        return arm.optimizer
    lever = f", {arm.tag}" if arm.tag else ""
    return f"{arm.optimizer} + K-FAC ({'tuned' if arm.knobs else 'library defaults'}{lever})"


def markdown_heldout(campaign: Campaign) -> str:
    """The held-out table of a case, as markdown."""
    rows = heldout_rows(campaign)
    if not rows:
        return "_No held-out records yet._\n"
    first_order = [r for r in rows if not r.arm.kfac]
    peer = min(first_order, key=lambda r: r.median_time_s) if first_order else None
    by_kind = {r.arm.kind: r for r in rows if not r.arm.kfac}
    # the CPU clock's column where any arm has it (records written since it was kept)
    with_cpu = any(r.cpu_ms is not None for r in rows)
    lines = [
        "| arm | selected setting | reached | steps to target | time to target (s) "
        f"| ms/step{' | CPU ms/step | CPU time to target (s)' if with_cpu else ''} "
        f"| time vs {arm_label(peer.arm) if peer else 'best first-order'} | time vs its base |",
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if with_cpu else ""),
    ]
    for row in rows:
        base = by_kind.get(row.arm.optimizer) if row.arm.kfac else None
        cost = "-" if row.step_ms is None else f"{row.step_ms:.1f}"
        if with_cpu:
            cost += " | -" if row.cpu_ms is None else f" | {row.cpu_ms:.1f}"
            cost += " | -" if row.cpu_time_s is None else f" | {_seconds(row.cpu_time_s)}"
        vs_peer = _paired_cell(row, peer)
        vs_base = _paired_cell(row, base)
        lines.append(
            f"| {arm_label(row.arm)} | {row.setting} | {row.reached}/{row.seeds} "
            f"| {_fmt(row.steps, '.0f')} | {_fmt(row.time_s, '.3g')} | {cost} "
            f"| {vs_peer} | {vs_base} |"
        )
    return "\n".join(lines) + "\n"


#: a ratio of times to target within this band of 1 is called a tie
TIE = 0.05


def _read_ratio(ratio: float, *, nan: str, inf: str, win: str, lose: str) -> str:
    """A ratio of times to target read with the tie band (:data:`TIE`)."""
    if math.isnan(ratio):
        return nan
    if math.isinf(ratio):
        return inf
    if ratio < 1 - TIE:
        return win
    return lose if ratio > 1 + TIE else "a tie"


def verdict(ratio: float) -> str:
    """What a user reads from a paired ratio of times to target (K-FAC arm / its base)."""
    return _read_ratio(
        ratio,
        nan="neither reaches the target",
        inf="keep the optimizer alone (K-FAC misses the target)",
        win="add K-FAC",
        lose="keep the optimizer alone",
    )


def markdown_summary(campaigns: Sequence[Campaign]) -> str:
    """Which K-FAC to use when: per family, global batch and base optimizer,
    held-out medians.

    Each row: the base optimizer's median time to target, K-FAC at the library's
    defaults and tuned as paired ratios of it (:func:`paired_ratio`), the
    best first-order arm of the family and the defaults arm against it, and
    the verdict at the library's defaults. A family still being measured —
    an arm the table reads (every arm but the levers) not yet selected, or
    without a record of every held-out seed — is left out: a figure over the
    seeds that happen to be done is not the comparison the protocol defines.
    A lever arm still being measured holds nothing back: its own table
    (:func:`markdown_levers`) reports it. The families left out are named
    under the table (without rows, in place of it), so a reader knows the
    table is not all there is."""
    measuring: list[str] = []
    lines = [
        "| family | batch | base optimizer | base: time to target (s) | + K-FAC, library "
        "defaults | + K-FAC, tuned | best first-order | defaults vs best | at the defaults |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for campaign in campaigns:
        rows = complete_rows(campaign, levers=False)
        if rows is None:
            measuring.append(f"`{campaign.case.name}`")
            continue
        first = {r.arm.optimizer: r for r in rows if not r.arm.kfac}
        if not first:
            continue
        peer = min(first.values(), key=lambda r: r.median_time_s)
        batch = campaign.case.global_batch
        for optimizer, base in first.items():
            defaults = next(
                (
                    r
                    for r in rows
                    if r.arm.kfac and not r.arm.knobs and r.arm.optimizer == optimizer
                ),
                None,
            )
            if defaults is None:
                continue
            tuned = next((r for r in rows if r.arm.knobs and r.arm.optimizer == optimizer), None)
            ratio = paired_ratio(defaults, base)
            lines.append(
                f"| {campaign.case.name} | {batch} | {optimizer} "
                f"| {_seconds(base.median_time_s)} | {time_cell(defaults, base)} "
                f"| {time_cell(tuned, base)} "
                f"| {peer.arm.optimizer} ({_seconds(peer.median_time_s)} s) "
                f"| {time_cell(defaults, peer)} | {_verdict_cell(defaults, base, ratio)} |"
            )
    return with_measuring(lines, measuring, "No family has been measured yet.\n")


def with_measuring(lines: Sequence[str], measuring: Sequence[str], empty: str) -> str:
    """A table (``lines``: its header, its separator, its rows) and under it
    the cases still being measured, named; without rows, only those names
    (``empty`` where there are none either)."""
    note = (
        f"Still being measured (not every arm held out): {', '.join(measuring)}; "
        "`kaisa bench status CASE` shows where each stands.\n"
    )
    if len(lines) == 2:
        return note if measuring else empty
    return "\n".join(lines) + "\n" + (f"\n{note}" if measuring else "")


def _verdict_cell(row: ArmRow, base: ArmRow, ratio: float | None) -> str:
    """:func:`verdict` of a paired ratio; where there is none, why."""
    if ratio is not None:
        return verdict(ratio)
    return "not paired (trained apart)" if trained_apart(row, base) else "-"


def time_cell(row: ArmRow | None, base: ArmRow | None) -> str:
    """``row``'s time to target over ``base``'s (paired), as ``0.83×`` (``-`` where undefined)."""
    text = _paired_cell(row, base)
    return text if text in ("-", "apart") else f"{text}×"


def _paired_cell(
    row: ArmRow | None,
    ref: ArmRow | None,
    value: Callable[[Mapping[str, Any]], float | None] = time_to_target,
) -> str:
    """A table cell of :func:`paired_ratio`: ``-`` where it has no finite,
    positive value, ``apart`` where a wall-clock figure has no seed whose
    runs stepped side by side (:func:`trained_apart`)."""
    if row is None or ref is None:
        return "-"
    if value in _WALL_CLOCK and trained_apart(row, ref):
        return "apart"
    return _cell(paired_ratio(row, ref, value))


def _cell(ratio: float | None) -> str:
    """A ratio as a table cell: ``-`` where it has no finite, positive value."""
    return f"{ratio:.2f}" if ratio is not None and math.isfinite(ratio) and ratio > 0 else "-"


def quotient(a: float, b: float) -> float:
    """``a / b`` for times or steps where a miss is infinite: both missing is
    no ratio (NaN), only ``b`` missing is 0 (``a`` wins outright)."""
    if math.isinf(a) and math.isinf(b):
        return math.nan
    if math.isinf(b):
        return 0.0 if math.isfinite(a) else math.nan
    return a / b if b > 0 else math.nan


def _seconds(value: float) -> str:
    return "not reached" if math.isinf(value) else f"{value:.3g}"


def lever_verdict(ratio: float) -> str:
    """What a lever bought, from its time to target over K-FAC's at the defaults (paired)."""
    if ratio == 0.0:  # the lever reaches the target, K-FAC at the defaults does not
        return "wins (the defaults miss the target)"
    finite = math.isfinite(ratio)
    return _read_ratio(
        ratio,
        nan="neither reaches the target",
        inf="loses (misses the target)",
        win=f"wins ({1 - ratio:.0%} less time)" if finite else "",
        lose=f"loses ({ratio - 1:.0%} more time)" if finite else "",
    )


def markdown_levers(campaign: Campaign) -> str:
    """What each lever bought: its held-out figures over those of K-FAC at the
    library's defaults on the same base optimizer, paired by seed
    (:func:`paired_ratio`) — steps, the step's cost and the time to target,
    so a win or a loss reads as fewer steps or a cheaper step.

    The step's cost is its CPU time where both arms' records have it (the
    cost whatever else the machine ran), the wall clock's otherwise; the
    time to target is read on both clocks (the verdict on the wall clock's,
    the protocol's measure)."""
    levers = lever_pairs(heldout_rows(campaign))
    if not levers:
        return "_No lever arm held out yet._\n"
    lines = [
        "| lever | K-FAC at the defaults on | reached | steps vs defaults | step cost vs defaults "
        "| time vs defaults | CPU time vs defaults | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, ref in levers:
        if ref is None:
            lines.append(f"| {row.arm.kind} | {row.arm.optimizer}: not held out | | | | | | |")
            continue
        ratio = paired_ratio(row, ref)
        if ratio is not None:
            word = lever_verdict(ratio)
        else:
            word = "not paired (trained apart)" if trained_apart(row, ref) else "-"
        lines.append(
            f"| {row.arm.kind} | {row.arm.optimizer} | {row.reached}/{row.seeds} "
            f"| {_paired_cell(row, ref, steps_to_target)} | {_step_cost_ratio(row, ref)} "
            f"| {_paired_cell(row, ref)} | {_paired_cell(row, ref, _cpu_time)} "
            f"| {word} |"
        )
    return "\n".join(lines) + "\n"


def lever_pairs(rows: Sequence[ArmRow]) -> list[tuple[ArmRow, ArmRow | None]]:
    """Each lever arm's row with that of K-FAC at the library's defaults on the
    same base optimizer (None while that one is not held out)."""
    plain = {r.arm.optimizer: r for r in rows if r.arm.kfac and not r.arm.tag and not r.arm.knobs}
    return [(r, plain.get(r.arm.optimizer)) for r in rows if r.arm.tag]


def lever_word(ratio: float) -> str:
    """A lever's paired time ratio in a word: ``win``, ``tie``, ``loss`` or,
    where neither arm reaches the target, ``neither``."""
    if ratio == 0.0:  # the lever reaches the target, the defaults do not
        return "win"
    return _read_ratio(ratio, nan="neither", inf="loss", win="win", lose="loss").replace(
        "a tie", "tie"
    )


def across_cell(ratio: float | None) -> str:
    """One family's cell of :func:`markdown_levers_across`."""
    if ratio is None:
        return "-"
    if math.isfinite(ratio) and ratio > 0:
        return f"{ratio:.2f}× {lever_word(ratio)}"
    return {0.0: "win (the defaults miss)", math.inf: "loss (misses)"}.get(ratio, "neither")


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


def markdown_levers_across(campaigns: Sequence[Campaign]) -> str:
    """Each lever on every case that runs it: its time to target over K-FAC's at
    the library's defaults on the same base, paired by seed
    (:func:`paired_ratio`; "-" where it is not held out yet), and what the
    families measured say together.  The row a change of the library's
    defaults is read from: a lever that wins on every family is a candidate
    default, one that loses on any is not."""
    names = [c.case.name for c in campaigns]
    ratios, apart = lever_ratios(campaigns)
    lines = [
        "| lever | " + " | ".join(f"`{n}`" for n in names) + " | the families measured |",
        "|---|" + "---|" * len(names) + "---|",
    ]
    for kind, by_case in ratios.items():
        words = sorted({lever_word(r) for r in by_case.values()})
        n = len(by_case)
        families = f"{n} {'family' if n == 1 else 'families'}"
        if not n:
            across = "not paired yet" if any(k == kind for k, _ in apart) else "not held out yet"
        elif len(words) == 1:
            across = f"{words[0]} ({families})"
        else:
            across = f"mixed ({families}): {', '.join(words)}"
        cells = " | ".join(
            "apart" if (kind, name) in apart else across_cell(by_case.get(name)) for name in names
        )
        lines.append(f"| {kind} | {cells} | {across} |")
    return "\n".join(lines) + "\n"


def _step_cost_ratio(row: ArmRow, ref: ArmRow) -> str:
    """``row``'s step cost over ``ref``'s, paired by seed: CPU times where both
    have them (marked ``CPU``), wall times otherwise."""
    if row.cpu_ms is not None and ref.cpu_ms is not None:
        return f"{_paired_cell(row, ref, _cpu_ms)} (CPU)"
    return _paired_cell(row, ref, _step_ms)


def markdown_machine(campaign: Campaign) -> str:
    """Where and when the held-out runs were made, read from their records."""
    rows = heldout_rows(campaign)
    envs = [r["environment"] for row in rows for r in row.records]
    if not envs:
        return "_No held-out records yet._\n"
    machines = sorted({f"{e['machine']['gpu'] or e['machine']['cpu']} ({e['machine']['cpus']} CPUs)"
                       for e in envs})  # fmt: skip
    threads = sorted({e["threads"] for e in envs})
    torch_versions = sorted({e["versions"]["torch"] for e in envs})
    commits = sorted({(e["git_commit"] or "?")[:10] for e in envs})
    dates = sorted(e["date"][:10] for e in envs)
    loads = [v for e in envs for v in e["load_1min"].values() if v is not None]
    load = f"; 1-minute load {min(loads):.1f}–{max(loads):.1f}" if loads else ""
    return (
        f"Held-out runs: {len(envs)} on {', '.join(machines)}, {'/'.join(map(str, threads))} "
        f"torch thread(s), torch {', '.join(torch_versions)}, commit {', '.join(commits)}, "
        f"{dates[0]}{'' if dates[0] == dates[-1] else ' to ' + dates[-1]}{load}.\n"
    )


def markdown_tuning(campaign: Campaign) -> str:
    """Every setting each arm tried, median over the selection seeds; the choice
    in bold. A setting that changes a step's work shows its measured step cost
    (its cost pair's ratio, ``pending`` until measured), which its steps are
    weighed by; every other setting's step costs the arm's own (``-``)."""
    seeds = campaign.protocol.selection_seeds
    lines = [
        "| arm | setting | reached | median steps | step cost | median time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for arm in campaign.case.arms:
        state = campaign.state(arm)
        for setting in state.tried:
            results = [r["result"] for r in campaign.records(arm, setting, seeds)]
            reached = [r for r in results if r["reached"]]
            times = [r["time_to_target_s"] if r["reached"] else math.inf for r in results]
            steps = [r["steps_to_target"] if r["reached"] else math.inf for r in results]
            med_t = statistics.median(times) if times else math.inf
            med_s = statistics.median(steps) if steps else math.inf
            priced = work_base(setting) is not None
            cost = campaign.step_cost(arm, setting) if priced else None
            text = setting.describe()
            if setting == state.selected:
                text = f"**{text}**"
            lines.append(
                f"| {arm_label(arm)} | {text} | {len(reached)}/{len(results)} "
                f"| {'-' if math.isinf(med_s) else f'{med_s:.0f}'} "
                f"| {'-' if not priced else 'pending' if cost is None else f'{cost:.2f}×'} "
                f"| {'-' if math.isinf(med_t) else f'{med_t:.3g}'} |"
            )
    return "\n".join(lines) + "\n"


def markdown_selection(campaign: Campaign) -> str:
    """Per arm, the selected setting (the protocol's rule: fewest median steps,
    weighed by step cost where a setting changes a step's work) beside the one
    with the lowest median wall time to target
    (:func:`kaisa_lab.bench.protocol.fastest`), each with its median steps and
    time: where they differ, the clock would have chosen by the load its
    group ran under."""
    seeds = campaign.protocol.selection_seeds
    lines = [
        "| arm | selected (steps) | its steps, time (s) | fastest on its clock "
        "| its steps, time (s) |",
        "|---|---|---|---|---|",
    ]
    for arm in campaign.case.arms:
        state = campaign.state(arm)
        if state.selected is None:
            continue
        results = {s: campaign.outcomes(arm, s, seeds) for s in state.tried}
        clock = fastest(results)
        if clock is None:
            continue
        same = "same" if clock == state.selected else clock.describe()
        lines.append(
            f"| {arm_label(arm)} | {state.selected.describe()} "
            f"| {_medians(results[state.selected])} | {same} | {_medians(results[clock])} |"
        )
    return "\n".join(lines) + "\n"


def _medians(outcomes: Sequence[Outcome]) -> str:
    """A setting's median steps and time to target, as ``140, 23`` (``-``: not reached)."""
    steps = [o.steps if o.steps is not None else math.inf for o in outcomes]
    times = [o.time_s if o.time_s is not None else math.inf for o in outcomes]
    n, t = statistics.median(steps), statistics.median(times)
    return f"{'-' if math.isinf(n) else f'{n:.0f}'}, {_seconds(t)}"
