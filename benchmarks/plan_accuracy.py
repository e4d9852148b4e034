"""How well ``kaisa plan`` predicts K-FAC's step overhead on this machine.

For each model of ``step_time.py`` (batch 128, one process) and three
settings, the planner predicts the time K-FAC adds to a step from a cost
model measured here (eigh, Cholesky inverse, matmul rate, copy bandwidth)
and the rows a probe forward counts; the measured overhead is the K-FAC
step minus the plain SGD step.  The overhead is also split by stage —
capture (forward+backward with hooks minus without), factor reduction and
running averages, decompositions, preconditioning (with KL clip and write
back) — beside the planner's stage of the same name, so a wrong prediction
points at the stage that is wrong.

The timed window holds a whole number of inverse-update intervals (at least
``--steps``), so decompositions are amortised as the planner amortises them.

On a machine shared with other jobs wall time measures the neighbours; the
default is one thread and the process's CPU time (``--clock cpu``), for the
cost model and the steps alike, which is what an idle core would take.
``--clock wall`` times the wall clock instead.

Prints a table with the errors, writes ``plan_accuracy.json`` and
``plan_accuracy.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kaisa import KFACPreconditioner
from kaisa.planner.costs import measure_costs
from kaisa.planner.forecast import forecast, layer_costs
from kaisa.planner.probe import probe_rows

sys.path.insert(0, str(Path(__file__).parent))
from step_time import MODELS

SETTINGS: dict[str, dict[str, Any]] = {
    "f=1 inv=10": dict(factor_update_steps=1, inv_update_steps=10),
    "f=10 inv=100": dict(factor_update_steps=10, inv_update_steps=100),
    "inverse f=1 inv=10": dict(
        factor_update_steps=1, inv_update_steps=10, compute_method="inverse"
    ),
}
#: measured phase -> the planner's stages it is compared with
STAGES = {
    "capture": ("capture",),
    "reduce_factors": ("factor_comm", "factor_fold"),
    "update_second_order": ("decompose", "inverse_comm"),
    "apply": ("precondition", "grad_comm"),
}
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def window(steps: int, kfac: dict[str, Any] | None) -> int:
    """At least ``steps``, a whole number of inverse intervals (3 warm-up steps
    first, so the window starts right after step 2 and holds steps/inv of them)."""
    every = 1 if kfac is None else int(kfac["inv_update_steps"])
    return every * math.ceil(steps / every)


def time_phases(
    model_name: str,
    kfac: dict[str, Any] | None,
    steps: int,
    batch: int,
    clock: Callable[[], float],
) -> dict[str, float]:
    """Seconds per step of the whole step and of each phase, over ``steps``."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=opt, **kfac) if kfac is not None else None
    spent: dict[str, float] = defaultdict(float)
    timing = [False]
    if precond is not None:
        pipeline = precond._parts.pipeline
        for phase in ("reduce_factors", "update_second_order", "apply"):
            original = getattr(pipeline, phase)

            def timed(*args: Any, _fn: Any = original, _phase: str = phase) -> Any:
                start = clock()
                out = _fn(*args)
                if timing[0]:
                    spent[_phase] += clock() - start
                return out

            setattr(pipeline, phase, timed)
    warmup = 3
    # a fresh batch every step: fitting one fixed batch drives K-FAC's
    # gradients into float32 denormals within a few steps, which makes CPU
    # matmuls 10-20x slower and would time the benchmark, not K-FAC
    gen = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(batch, 1, 28, 28, generator=gen),
            torch.randint(0, 10, (batch,), generator=gen),
        )
        for _ in range(steps + warmup)
    ]
    start = 0.0
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            timing[0] = True
            start = clock()
        t0 = clock()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if timing[0]:
            spent["forward_backward"] += clock() - t0
        if precond is not None:
            precond.step()
        opt.step()
    spent["step"] = clock() - start
    return {k: v / steps for k, v in spent.items()}


def median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--steps", type=int, default=30, help="at least this many timed steps")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    cost = measure_costs("cpu", sizes=(128, 256, 512, 1024, 2048), clock=clock)
    print(f"cost model ({args.clock} clock, {args.threads} thread(s)): {cost}", flush=True)
    rows_out = []
    for name, build in MODELS.items():
        model = build()
        rows = probe_rows(model, (torch.randn(1, 1, 28, 28),), scale=args.batch)
        layers = layer_costs(model, rows)
        sgd = median_phases(
            [
                time_phases(name, None, window(args.steps, None), args.batch, clock)
                for _ in range(args.repeats)
            ]
        )
        for setting, kfac in SETTINGS.items():
            predicted = forecast(layers, 1, cost, **kfac)
            steps = window(args.steps, kfac)
            measured = median_phases(
                [time_phases(name, kfac, steps, args.batch, clock) for _ in range(args.repeats)]
            )
            pred_ms = 1e3 * float(predicted.overhead()[0])
            meas_ms = 1e3 * (measured["step"] - sgd["step"])
            stages = {"capture": measured["forward_backward"] - sgd["forward_backward"]}
            stages |= {k: measured.get(k, 0.0) for k in STAGES if k != "capture"}
            stage_rows = {
                phase: {
                    "measured_ms": 1e3 * stages[phase],
                    "predicted_ms": 1e3 * sum(float(predicted.seconds[k][0]) for k in keys),
                }
                for phase, keys in STAGES.items()
            }
            stage_rows["rest"] = {
                "measured_ms": meas_ms - 1e3 * sum(stages.values()),
                "predicted_ms": 0.0,
            }
            row = {
                "model": name,
                "setting": setting,
                "timed_steps": steps,
                "sgd_ms": 1e3 * sgd["step"],
                "measured_overhead_ms": meas_ms,
                "predicted_overhead_ms": pred_ms,
                "predicted_step_ms": 1e3 * sgd["step"] + pred_ms,
                "measured_step_ms": 1e3 * measured["step"],
                "step_error": (1e3 * sgd["step"] + pred_ms) / (1e3 * measured["step"]) - 1,
                "overhead_error": pred_ms / meas_ms - 1 if meas_ms > 0 else None,
                "stages": stage_rows,
            }
            rows_out.append(row)
            print(
                f"{name:<20} {setting:<20} sgd {row['sgd_ms']:7.1f} ms  K-FAC overhead "
                f"measured {meas_ms:7.1f} predicted {pred_ms:7.1f} ms  step error "
                f"{100 * row['step_error']:+6.1f}%",
                flush=True,
            )
            print(
                "    "
                + "  ".join(
                    f"{k} {v['measured_ms']:.1f}/{v['predicted_ms']:.1f}"
                    for k, v in stage_rows.items()
                )
                + "  (ms measured/predicted)",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "repeats": args.repeats,
        "cost": vars(cost),
    }
    (args.out / "plan_accuracy.json").write_text(
        json.dumps({"meta": meta, "rows": rows_out}, indent=2)
    )
    print(f"wrote {args.out / 'plan_accuracy.json'}")
    plot(rows_out, args.out / "plan_accuracy.png")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 4))
    for r in rows:
        ax.scatter(r["measured_step_ms"], r["predicted_step_ms"])
        ax.annotate(
            f"{r['model'][:3]} {r['setting']}",
            (r["measured_step_ms"], r["predicted_step_ms"]),
            fontsize=6,
        )
    top = max(max(r["measured_step_ms"], r["predicted_step_ms"]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
