"""How the work plan scales: make_plan, describe() and the per-step lookups at
L layers and W ranks, for each grad_worker_fraction.  Prints a table and
writes JSON (no distributed job needed: the plan is pure).

    python benchmarks/plan_scale.py --layers 1000 --world 4096 --out runs/bench
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kaisa.distributed.plan import LayerSpec, make_plan


def measure(layers: int, world: int, fraction: float) -> dict[str, float]:
    specs = [
        LayerSpec.kfac(f"layer{i}", 256 + (i * 37) % 1024, 128 + (i * 53) % 512)
        for i in range(layers)
    ]
    t0 = time.perf_counter()
    plan = make_plan(specs, world, fraction)
    t1 = time.perf_counter()
    text = plan.describe()
    t2 = time.perf_counter()
    rank = world - 1
    for lp in plan.layers:  # what one step looks up, per layer
        lp.is_grad_worker(rank)
        lp.gradient_source(rank)
        plan.receiver_groups[rank % plan.grad_workers]
    t3 = time.perf_counter()
    return {
        "fraction": fraction,
        "make_plan_s": t1 - t0,
        "describe_s": t2 - t1,
        "describe_lines": float(len(text.splitlines())),
        "step_lookups_ms": (t3 - t2) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--world", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = parser.parse_args()
    rows = [measure(args.layers, args.world, f) for f in (1.0, 0.5, 1.0 / args.world)]
    print(f"plan at L={args.layers}, W={args.world}")
    header = ("fraction", "make_plan (s)", "describe (s)", "lines", "step lookups (ms)")
    print(f"{header[0]:>10} {header[1]:>14} {header[2]:>13} {header[3]:>6} {header[4]:>18}")
    for r in rows:
        print(
            f"{r['fraction']:>10.4g} {r['make_plan_s']:>14.3f} {r['describe_s']:>13.3f} "
            f"{r['describe_lines']:>6.0f} {r['step_lookups_ms']:>18.2f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_scale.json").write_text(
        json.dumps({"layers": args.layers, "world": args.world, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
