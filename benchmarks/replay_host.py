"""The host's own time in a replayed non-factor ``step()``, measured on CPU.

On a GPU a replayed non-factor step (``precond.compile(mode='reduce-overhead')``,
:mod:`kaisa.step.graphed`) launches one graph; what is left of its cost
is the Python around it — the checks, the schedule, the gradient marks —
and on the H200 that was what kept the MLP above the issue's 1.15× goal
(docs/benchmarks.md, "On a GPU").  That Python can be measured without a
GPU: the graph is replaced by a no-op here, gradients are reused
(``zero_grad(set_to_none=False)``: no copies), and ``step()`` is timed on
non-factor steps, beside the eager step under the accelerator's rule
(nothing read back).  Medians in µs; a table, ``replay_host.json`` and
``replay_host.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_step import Case, cases, loss_of
from kaisa import KFACPreconditioner
from kaisa.step.graphed import GraphedApplication
from step_launches import mlp_case


class NoGraph:
    """A recorder whose replay does nothing (the host's part alone)."""

    def record(self, work: Callable[[], None]) -> None:
        work()

    def replay(self) -> None:
        return None


def host_us(case: Case, replayed: bool, steps: int) -> float:
    """Median µs of ``step()`` over ``steps`` non-factor steps."""
    build, data = case
    torch.manual_seed(0)
    model = build()
    precond = KFACPreconditioner(
        model, factor_update_steps=10, inv_update_steps=10_000, damping=0.01, kl_clip=0.001
    )
    pipeline = precond._parts.pipeline
    pipeline.application.read_scalars = False  # the accelerator's rule
    if replayed:
        pipeline.graphed = GraphedApplication(pipeline.application, NoGraph)
    x, y = data(torch.Generator().manual_seed(1))
    times: list[float] = []
    while len(times) < steps:
        model.zero_grad(set_to_none=False)
        loss_of(model(x), y).backward()
        timed = pipeline.steps > 1 and not pipeline.schedule.is_factor_step(pipeline.steps)
        start = time.perf_counter()
        precond.step()
        if timed:
            times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "lm-2x128", "lm-12x64"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/replay_host"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batch = 8  # small: the products are not what is measured
    every = {"mlp": mlp_case(batch), **cases(batch)}
    rows: list[dict[str, Any]] = []
    print("| model | layers | eager step() µs | replayed step() µs | replayed µs per layer |")
    print("|---|---|---|---|---|")
    for name in args.models:
        case = every[name]
        layers = len(KFACPreconditioner(case[0]()).layers)
        eager = host_us(case, False, args.steps)
        replayed = host_us(case, True, args.steps)
        rows.append({"model": name, "layers": layers, "eager_us": eager, "replayed_us": replayed})
        print(f"| {name} | {layers} | {eager:.0f} | {replayed:.0f} | {replayed / layers:.1f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay_host.json").write_text(json.dumps({"results": rows}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["eager_us"] for r in rows], 0.4, label="eager")
    ax.bar([x + 0.2 for x in xs], [r["replayed_us"] for r in rows], 0.4, label="replayed (host)")
    ax.set_xticks(list(xs), [r["model"] for r in rows])
    ax.set_ylabel("µs in step(), non-factor")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "replay_host.png", dpi=120)


if __name__ == "__main__":
    main()
