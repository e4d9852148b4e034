"""Tables of a case, computed from its records only (its figures:
:mod:`kaisa_lab.bench.plots`, from the same rows).

The time-to-target tables:

- ``heldout``: the reported comparison. Per arm, its selected setting and,
  over the held-out seeds, the median [min–max] steps and time to target on
  the runs' own clocks, how many seeds reached it, the median step cost, and
  its time against the best first-order arm's and (for a K-FAC arm) its base
  optimizer's, as a paired ratio
  (:func:`~kaisa_lab.bench.rows.paired_ratio`: the median over the held-out
  seeds of the two arms' ratio on each seed, whose runs shared a lockstep
  group and so the machine's load). The rows are checked first: every arm
  started each held-out seed from the same weights and data order (the
  records' fingerprints); a mismatch is an error, not a row.
- ``between``: the held-out figures read at the evaluations beside the
  same read between them (where each run's curve crossed the target within
  its evaluation interval);
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
from typing import Any

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import Arm
from kaisa_lab.bench.protocol import Outcome, fastest, work_base
from kaisa_lab.bench.rows import (
    WALL_CLOCK,
    ArmRow,
    complete_rows,
    cpu_step_ms,
    cpu_time_to_target,
    evaluated_every,
    heldout_rows,
    lever_pairs,
    lever_ratios,
    paired_ratio,
    step_ms,
    steps_between,
    steps_to_target,
    time_between,
    time_to_target,
    trained_apart,
)

__all__ = [
    "TIE",
    "across_cell",
    "arm_label",
    "lever_verdict",
    "lever_word",
    "markdown_between",
    "markdown_heldout",
    "markdown_levers",
    "markdown_levers_across",
    "markdown_machine",
    "markdown_selection",
    "markdown_summary",
    "markdown_tuning",
    "time_cell",
    "verdict",
    "with_measuring",
]


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


def _references(rows: Sequence[ArmRow]) -> tuple[ArmRow | None, dict[str, ArmRow]]:
    """What a case's rows are read against: the best first-order arm (the
    fastest by median time to target; None without one) and each first-order
    arm by name, a K-FAC arm's base."""
    first_order = [r for r in rows if not r.arm.kfac]
    peer = min(first_order, key=lambda r: r.median_time_s) if first_order else None
    return peer, {r.arm.kind: r for r in first_order}


def markdown_heldout(campaign: Campaign) -> str:
    """The held-out table of a case, as markdown."""
    rows = heldout_rows(campaign)
    if not rows:
        return "_No held-out records yet._\n"
    peer, by_kind = _references(rows)
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


def markdown_between(campaign: Campaign) -> str:
    """The held-out figures read at the evaluations beside the same read
    between them (:func:`~kaisa_lab.bench.rows.steps_between`): per arm, how
    often its runs were evaluated, its steps to target both ways (median
    [min–max] over the seeds that reached it) and its time against the best
    first-order arm's and its base optimizer's, paired by seed, both ways.

    Why: a step count read every few steps moves in jumps of one interval,
    which near a short run's target can be larger than the difference two
    arms make; the straight line between the two evaluations around the
    crossing says where within the interval each run crossed. The protocol's
    figures stay those read at the evaluations (the held-out table)."""
    rows = heldout_rows(campaign)
    if not rows:
        return "_No held-out records yet._\n"
    peer, by_kind = _references(rows)
    name = arm_label(peer.arm) if peer else "best first-order"
    lines = [
        "| arm | evaluated every (steps) | steps to target | between evaluations "
        f"| time vs {name} | between evaluations | time vs its base | between evaluations |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = by_kind.get(row.arm.optimizer) if row.arm.kfac else None
        every = evaluated_every(row.records)
        reached = [steps_between(r) for r in row.records if r["result"]["reached"]]
        between = (statistics.median(reached), min(reached), max(reached)) if reached else None
        lines.append(
            f"| {arm_label(row.arm)} | {'-' if every is None else every} "
            f"| {_fmt(row.steps, '.0f')} | {_fmt(between, '.0f')} "
            f"| {_paired_cell(row, peer)} | {_paired_cell(row, peer, time_between)} "
            f"| {_paired_cell(row, base)} | {_paired_cell(row, base, time_between)} |"
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
    defaults and tuned as paired ratios of it (:func:`~kaisa_lab.bench.rows.paired_ratio`), the
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
    """A table cell of :func:`~kaisa_lab.bench.rows.paired_ratio`: ``-`` where it has no finite,
    positive value, ``apart`` where a wall-clock figure has no seed whose
    runs stepped side by side (:func:`~kaisa_lab.bench.rows.trained_apart`)."""
    if row is None or ref is None:
        return "-"
    if value in WALL_CLOCK and trained_apart(row, ref):
        return "apart"
    return _cell(paired_ratio(row, ref, value))


def _cell(ratio: float | None) -> str:
    """A ratio as a table cell: ``-`` where it has no finite, positive value."""
    return f"{ratio:.2f}" if ratio is not None and math.isfinite(ratio) and ratio > 0 else "-"


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
    (:func:`~kaisa_lab.bench.rows.paired_ratio`) — steps, the step's cost and the time to target,
    so a win or a loss reads as fewer steps or a cheaper step.

    The step's cost is its CPU time where both arms' records have it (the
    cost whatever else the machine ran), the wall clock's otherwise; the
    time to target is read on both clocks (the verdict on the wall clock's,
    the protocol's measure); the steps and the wall clock's time are read
    between evaluations too (:func:`~kaisa_lab.bench.rows.steps_between`:
    where within its evaluation interval each run crossed the target)."""
    levers = lever_pairs(heldout_rows(campaign))
    if not levers:
        return "_No lever arm held out yet._\n"
    lines = [
        "| lever | K-FAC at the defaults on | reached | steps vs defaults | between evaluations "
        "| step cost vs defaults | time vs defaults | between evaluations | CPU time vs defaults "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, ref in levers:
        if ref is None:
            lines.append(f"| {row.arm.kind} | {row.arm.optimizer}: not held out |" + " |" * 8)
            continue
        ratio = paired_ratio(row, ref)
        if ratio is not None:
            word = lever_verdict(ratio)
        else:
            word = "not paired (trained apart)" if trained_apart(row, ref) else "-"
        lines.append(
            f"| {row.arm.kind} | {row.arm.optimizer} | {row.reached}/{row.seeds} "
            f"| {_paired_cell(row, ref, steps_to_target)} "
            f"| {_paired_cell(row, ref, steps_between)} | {_step_cost_ratio(row, ref)} "
            f"| {_paired_cell(row, ref)} | {_paired_cell(row, ref, time_between)} "
            f"| {_paired_cell(row, ref, cpu_time_to_target)} "
            f"| {word} |"
        )
    return "\n".join(lines) + "\n"


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


def markdown_levers_across(campaigns: Sequence[Campaign]) -> str:
    """Each lever on every case that runs it: its time to target over K-FAC's at
    the library's defaults on the same base, paired by seed
    (:func:`~kaisa_lab.bench.rows.paired_ratio`; "-" where it is not held out yet), and what the
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
        return f"{_paired_cell(row, ref, cpu_step_ms)} (CPU)"
    return _paired_cell(row, ref, step_ms)


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
    weighed by; every other setting's step costs the arm's own (``-``). A
    setting its deciding seeds settled (:func:`~kaisa_lab.bench.protocol.settled`)
    says on how many seeds it ran."""
    seeds = campaign.protocol.selection_seeds
    lines = [
        "| arm | setting | reached | median steps | step cost | median time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for arm in campaign.case.arms:
        state = campaign.state(arm)
        out = campaign.settled(arm, state.tried)
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
            if setting in out and len(results) < len(seeds):
                text += f" (settled on {len(results)} seeds)"
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
