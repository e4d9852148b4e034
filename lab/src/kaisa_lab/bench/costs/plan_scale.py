"""How the work plan scales: ``make_plan``, ``describe()`` and the per-step lookups
at L layers and W ranks, for COMM-OPT (1), HYBRID-OPT (1/2) and MEM-OPT (1/W).

The plan is pure (no distributed job): L layers of varied sizes
(``256 + 37i mod 1024`` by ``128 + 53i mod 512``) are planned over W ranks.
Each layer's workers are a column of the m × n rank grid shared by reference
across layers, receiver groups are derived, per-step lookups are arithmetic
and ``describe()`` summarises past 64 ranks or layers, so every figure stays
small at L = 1000, W = 4096.  Timed, in turns (:func:`kaisa_lab.bench.timer.interleave`,
``rounds`` times after a warm-up): ``make_plan``, ``describe()`` and what one
step looks up for every layer on the last rank (``is_grad_worker``,
``gradient_source``, its receiver group).  ``describe_lines`` is exact; the
times depend on the machine, so no docs table is rendered from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kaisa.distributed.plan import LayerSpec, make_plan
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Records, Row, TimingCase, register

__all__ = ["CASE"]


def fraction_label(fraction: float, world: int) -> str:
    """``1 (COMM-OPT)``, ``1/2 (HYBRID-OPT)``, ``1/4096 (MEM-OPT)``."""
    if fraction == 1:
        return "1 (COMM-OPT)"
    name = "MEM-OPT" if round(fraction * world) == 1 else "HYBRID-OPT"
    return f"1/{round(1 / fraction)} ({name})"


def _specs(layers: int) -> list[LayerSpec]:
    return [
        LayerSpec.kfac(f"layer{i}", 256 + (i * 37) % 1024, 128 + (i * 53) % 512)
        for i in range(layers)
    ]


def measure(options: Mapping[str, Any]) -> list[Row]:
    layers, world = int(options["layers"]), int(options["world"])
    specs = _specs(layers)
    rank = world - 1
    arms: dict[str, Callable[[], object]] = {}
    lines: dict[float, int] = {}
    fractions = list(dict.fromkeys((1.0, 0.5, 1.0 / world)))
    for f in fractions:
        plan = make_plan(specs, world, f)
        lines[f] = len(plan.describe().splitlines())

        def planned(f: float = f) -> object:
            return make_plan(specs, world, f)

        def lookups(plan: Any = plan) -> None:  # what one step looks up, per layer
            for lp in plan.layers:
                lp.is_grad_worker(rank)
                lp.gradient_source(rank)
                plan.receiver_groups[rank % plan.grad_workers]

        arms[f"{f} make_plan"] = planned
        arms[f"{f} describe"] = plan.describe
        arms[f"{f} lookups"] = lookups
    timed = interleave(arms, rounds=int(options["rounds"]))
    return [
        Row(
            f"f={fraction_label(f, world).split()[0]}",
            {"layers": layers, "world_size": world, "grad_worker_fraction": f},
            {
                "describe_lines": lines[f],
                "make_plan_s": timed[f"{f} make_plan"].median_ms / 1e3,
                "describe_s": timed[f"{f} describe"].median_ms / 1e3,
                "step_lookups_ms": timed[f"{f} lookups"].median_ms,
            },
        )
        for f in fractions
    ]


def table(records: Records) -> str:
    rows = sorted(records, key=lambda r: -r["config"]["grad_worker_fraction"])
    lines = [
        "| grad_worker_fraction | make_plan (s) | describe (s) | describe lines "
        "| per-step lookups, all layers (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        c, s = r["config"], r["result"]
        lines.append(
            f"| {fraction_label(c['grad_worker_fraction'], c['world_size'])} "
            f"| {s['make_plan_s']:.3f} | {s['describe_s']:.3f} | {s['describe_lines']} "
            f"| {s['step_lookups_ms']:.2f} |"
        )
    first = rows[0]["config"] if rows else {"layers": "?", "world_size": "?"}
    return f"L = {first['layers']}, W = {first['world_size']}\n\n" + "\n".join(lines) + "\n"


CASE = register(
    TimingCase(
        name="plan-scale",
        description="make_plan, describe() and the per-step lookups at L layers and W ranks",
        measure=measure,
        options={"layers": 1000, "world": 4096, "rounds": 3},
        quick={"layers": 200, "world": 256, "rounds": 1},
        tables={"scale": table},
    )
)
