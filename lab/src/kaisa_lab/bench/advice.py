"""Which K-FAC to use with which base optimizer, at which global batch.

The summary (:func:`kaisa_lab.bench.report.markdown_summary`) reads K-FAC at
the library's defaults and tuned; a lever (K-FAC on Muon's AdamW part only,
cheaper factors) is a change a user makes to the defaults, so it is read
here beside them. For each case held out and each base optimizer K-FAC runs
on there: the K-FAC arm with the shortest median time to target over the
held-out seeds, against that optimizer alone (where the case runs it) and
against the case's fastest first-order arm, each ratio paired by seed
(:func:`~kaisa_lab.bench.rows.paired_ratio`). A case still being measured
is named under the table, as the summary names its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.report import TIE, arm_label, time_cell, with_measuring
from kaisa_lab.bench.rows import ArmRow, complete_rows, paired_ratio

__all__ = ["compared_arms", "fastest_kfac", "markdown_advice", "reading"]


def fastest_kfac(rows: Sequence[ArmRow], optimizer: str) -> ArmRow | None:
    """The K-FAC arm on ``optimizer`` with the shortest median time to target."""
    mine = [r for r in rows if r.arm.kfac and r.arm.optimizer == optimizer]
    return min(mine, key=lambda r: r.median_time_s, default=None)


def compared_arms(campaign: Campaign) -> list[str] | None:
    """The arms a time to target elsewhere (a GPU) compares, by name: AdamW
    and Muon (where the case runs them), its fastest first-order arm and its
    fastest K-FAC arm over every base (a lever as much as the defaults); None
    while the case is not held out (no arm is fastest yet)."""
    rows = complete_rows(campaign)
    if rows is None:
        return None
    first = [r for r in rows if not r.arm.kfac]
    kfac = [r for r in rows if r.arm.kfac]
    names = [r.arm.name for r in first if r.arm.optimizer in ("adamw", "muon") and not r.arm.lever]
    for group in (first, kfac):
        if group:
            names.append(min(group, key=lambda r: r.median_time_s).arm.name)
    return list(dict.fromkeys(names))


def reading(ratio: float | None, peer: str) -> str:
    """A paired time ratio of K-FAC's best arm over the fastest first-order
    arm ``peer``, read with the summary's tie band."""
    if ratio is None or math.isnan(ratio):
        return "-"
    if ratio == 0.0:
        return f"faster than {peer} (it misses the target)"
    if math.isinf(ratio):
        return "misses the target"
    if ratio < 1 - TIE:
        return "faster than every first-order arm"
    return f"{peer} is faster" if ratio > 1 + TIE else f"a tie with {peer}"


def markdown_advice(campaigns: Sequence[Campaign]) -> str:
    """The table: one row per case held out and base optimizer K-FAC runs on."""
    measuring: list[str] = []
    lines = [
        "| case | batch | base optimizer | fastest K-FAC arm | vs the optimizer alone "
        "| fastest first-order | vs it | reading |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for campaign in campaigns:
        rows = complete_rows(campaign)
        if rows is None:
            measuring.append(f"`{campaign.case.name}`")
            continue
        first = [r for r in rows if not r.arm.kfac]
        if not first:
            continue
        peer = min(first, key=lambda r: r.median_time_s)
        alone = {r.arm.optimizer: r for r in first}
        for optimizer in dict.fromkeys(r.arm.optimizer for r in rows if r.arm.kfac):
            best = fastest_kfac(rows, optimizer)
            assert best is not None  # the optimizer is one K-FAC runs on
            to_peer = paired_ratio(best, peer)
            lines.append(
                f"| {campaign.case.name} | {campaign.case.global_batch} | {optimizer} "
                f"| {arm_label(best.arm)} "
                f"| {time_cell(best, alone.get(optimizer))} "
                f"| {peer.arm.optimizer} | {time_cell(best, peer)} "
                f"| {reading(to_peer, peer.arm.optimizer)} |"
            )
    return with_measuring(lines, measuring, "No case has been measured yet.\n")
