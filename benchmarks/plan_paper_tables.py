"""The markdown tables docs/planning.md shows, rendered from plan_paper.py's rows.

``plan_paper.py --markdown TABLE --models MODEL`` prints one of them, so
``tools/docs_check.py`` regenerates the tables from the planner instead of
trusting numbers typed in once: ``memory`` (K-FAC memory and bytes per step
per W and fraction, and the bytes of an inverse update), ``overhead``
(predicted ms per step, and the fraction ``'auto'`` picks in every link
scenario) and ``stages`` (where the time goes at one W).  Rows whose cells
are all equal for consecutive W are merged (``64 … 1024``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: the columns of the tables: MEM-OPT, 1/8, 1/4, HYBRID-OPT, COMM-OPT
COLUMNS = ("1/W", "1/8", "1/4", "1/2", "1")
#: stage keys of kaisa.planner.forecast.STAGES and the names the table gives them
STAGE_NAMES = {
    "capture": "capture",
    "factor_comm": "factor reduce",
    "factor_fold": "fold",
    "decompose": "decompose",
    "inverse_comm": "inverse bcast",
    "precondition": "precondition",
    "grad_comm": "gradient bcast",
}
SAME_AS_MEM_OPT = "(= 1/W)"


def fraction_label(f: float) -> str:
    if f == 1.0:
        return "1"
    return f"1/{round(1 / f)}" if abs(1 / f - round(1 / f)) < 1e-9 else f"{f:.3g}"


def _by_column(rows: Sequence[dict[str, Any]], world: int) -> dict[str, dict[str, Any] | None]:
    """The rows at ``world`` under their column; None where 1/8 is 1/W (W = 8)."""
    mine = {r["grad_worker_fraction"]: r for r in rows if r["world_size"] == world}
    wanted = {"1/W": 1.0 / world, "1/8": 1 / 8, "1/4": 0.25, "1/2": 0.5, "1": 1.0}
    out: dict[str, dict[str, Any] | None] = {}
    for column, f in wanted.items():
        out[column] = None if column != "1/W" and f == 1.0 / world else mine[f]
    return out


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def _merged(worlds: Sequence[int], cells: Callable[[int], list[str]]) -> list[list[str]]:
    """One row per run of consecutive W with equal cells, labelled ``first … last``."""
    out: list[list[str]] = []
    runs: list[tuple[int, int, list[str]]] = []
    for w in worlds:
        row = cells(w)
        if runs and runs[-1][2] == row:
            runs[-1] = (runs[-1][0], w, row)
        else:
            runs.append((w, w, row))
    for first, last, row in runs:
        out.append([str(first) if first == last else f"{first} … {last}", *row])
    return out


def memory_table(rows: Sequence[dict[str, Any]], worlds: Sequence[int], at: int) -> list[str]:
    """MiB per rank and MB per step per W and fraction, then an inverse update's MB at W=``at``."""

    def cells(w: int) -> list[str]:
        cols = _by_column(rows, w)
        mib = [SAME_AS_MEM_OPT if r is None else f"{r['memory_mib']:.0f}" for r in cols.values()]
        mb = [SAME_AS_MEM_OPT if r is None else f"{r['mb_per_step']:.0f}" for r in cols.values()]
        return mib + mb

    header = ["W", *(f"MiB {c}" for c in COLUMNS), *(f"MB/step {c}" for c in COLUMNS)]
    lines = _table(header, _merged(worlds, cells))
    inverse = ", ".join(
        f"{r['mb_inverse_update']:.0f} ({c})"
        for c, r in _by_column(rows, at).items()
        if r is not None
    )
    return [*lines, "", f"MB per inverse update at W = {at}: {inverse}."]


def overhead_table(
    rows: Sequence[dict[str, Any]],
    worlds: Sequence[int],
    picks: dict[str, dict[int, list[float]]],
) -> list[str]:
    """Predicted ms per step per W and fraction (the least in bold), and the
    fraction ``'auto'`` picks per group of scenarios (one pick per link speed)."""

    def cells(w: int) -> list[str]:
        cols = _by_column(rows, w)
        best = min(r["overhead_ms"] for r in cols.values() if r is not None)
        ms = []
        for r in cols.values():
            if r is None:
                ms.append(SAME_AS_MEM_OPT)
            else:
                text = f"{r['overhead_ms']:.1f}"
                ms.append(f"**{text}**" if r["overhead_ms"] == best else text)
        auto = [" / ".join(fraction_label(f) for f in group[w]) for group in picks.values()]
        return ms + auto

    header = ["W", *(f"ms {c}" for c in COLUMNS), *(f"auto, {name}" for name in picks)]
    return _table(header, [[str(w), *cells(w)] for w in worlds])


def stages_table(rows: Sequence[dict[str, Any]], world: int) -> list[str]:
    """Where each fraction's overhead goes at W=``world`` (ms per step, amortised)."""

    def ms(value: float) -> str:
        return "0" if value == 0 else f"{value:.1f}"

    body = []
    for r in sorted(
        (r for r in rows if r["world_size"] == world), key=lambda r: r["grad_worker_fraction"]
    ):
        stages = [ms(r["stages_ms"][k]) for k in STAGE_NAMES]
        body.append([fraction_label(r["grad_worker_fraction"]), *stages, ms(r["overhead_ms"])])
    return _table(["f", *STAGE_NAMES.values(), "total"], body)
