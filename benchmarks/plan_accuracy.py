"""How well ``kaisa plan`` predicts K-FAC's step overhead on this machine.

For each model of ``step_time.py`` (batch 128, one process) and two interval
settings, the planner predicts the time K-FAC adds to a step from a cost
model measured here (eigh, Cholesky inverse, matmul rate) and the rows a
probe forward counts; the measured overhead is the K-FAC step minus the
plain SGD step.  Prints a table with the error, writes
``plan_accuracy.json`` and ``plan_accuracy.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from kaisa.costs import measure_costs
from kaisa.forecast import forecast, layer_costs, probe_rows

sys.path.insert(0, str(Path(__file__).parent))
from step_time import MODELS, time_steps

SETTINGS: dict[str, dict[str, Any]] = {
    "f=1 inv=10": dict(factor_update_steps=1, inv_update_steps=10),
    "f=10 inv=100": dict(factor_update_steps=10, inv_update_steps=100),
    "inverse f=1 inv=10": dict(
        factor_update_steps=1, inv_update_steps=10, compute_method="inverse"
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cost = measure_costs("cpu", sizes=(128, 256, 512, 1024, 2048))
    print(f"cost model: {cost}", flush=True)
    rows_out = []
    for name, build in MODELS.items():
        model = build()
        rows = probe_rows(model, (torch.randn(1, 1, 28, 28),), scale=args.batch)
        layers = layer_costs(model, rows)
        sgd = statistics.median(
            time_steps(name, None, args.steps, args.batch) for _ in range(args.repeats)
        )
        for setting, kfac in SETTINGS.items():
            predicted = forecast(layers, 1, cost, **kfac)
            measured = statistics.median(
                time_steps(name, kfac, args.steps, args.batch) for _ in range(args.repeats)
            )
            pred_ms = 1e3 * float(predicted.overhead()[0])
            meas_ms = 1e3 * (measured - sgd)
            row = {
                "model": name,
                "setting": setting,
                "sgd_ms": 1e3 * sgd,
                "measured_overhead_ms": meas_ms,
                "predicted_overhead_ms": pred_ms,
                "predicted_step_ms": 1e3 * sgd + pred_ms,
                "measured_step_ms": 1e3 * measured,
                "step_error": (1e3 * sgd + pred_ms) / (1e3 * measured) - 1,
                "overhead_error": pred_ms / meas_ms - 1 if meas_ms > 0 else None,
                "stages_ms": {k: 1e3 * float(v[0]) for k, v in predicted.seconds.items()},
            }
            rows_out.append(row)
            print(
                f"{name:<20} {setting:<20} sgd {row['sgd_ms']:7.1f} ms  K-FAC overhead "
                f"measured {meas_ms:7.1f} predicted {pred_ms:7.1f} ms  step error "
                f"{100 * row['step_error']:+6.1f}%",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cost": vars(cost)}
    (args.out / "plan_accuracy.json").write_text(
        json.dumps({"meta": meta, "rows": rows_out}, indent=2)
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 4))
    for r in rows_out:
        ax.scatter(r["measured_step_ms"], r["predicted_step_ms"])
        ax.annotate(
            f"{r['model'][:3]} {r['setting']}",
            (r["measured_step_ms"], r["predicted_step_ms"]),
            fontsize=6,
        )
    top = max(max(r["measured_step_ms"], r["predicted_step_ms"]) for r in rows_out) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    fig.tight_layout()
    fig.savefig(args.out / "plan_accuracy.png", dpi=120)


if __name__ == "__main__":
    main()
