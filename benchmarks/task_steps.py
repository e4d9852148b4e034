"""Per-step cost of K-FAC on the built-in tasks' own models, at their batch sizes.

The digits tasks' models are tiny (3-8 layers of 8-256 units, batch 64), so
what decides their time to target is not a kernel but the fixed cost of
``precond.step()`` per layer: reading, preconditioning, clipping and writing
each gradient.  For each task this prints, in milliseconds per step:

* ``first-order``: forward, backward and the optimizer step alone;
* ``K-FAC, mean``: the same with ``precond.step()`` at the library defaults
  (factors every 10 steps, inverses every 100), over a whole inverse
  interval, so every stage is amortised as in training;
* ``step(), plain step``: ``precond.step()`` alone on the steps that update
  nothing (9 in 10 at the defaults);
* ``floor``: the bare kernels such a step cannot avoid — each layer's two
  products ``G⁻¹ ∇ A⁻¹`` and ``⟨V, ∇⟩`` on random tensors of the same
  shapes, timed in the same process.

``--before DIR`` alternates fresh processes of this script on another tree's
``src`` and on this one's, ``--rounds`` times, and prints before → after.
Table on stdout, ``task_steps.json`` and ``task_steps.png`` under ``--out``.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

METRICS = ("first-order", "K-FAC, mean", "step(), plain step", "floor")


def _steps(task: Any, kfac: bool, steps: int) -> tuple[float, float]:
    """(ms per training step, ms per plain ``precond.step()``)."""
    from kaisa import KFACPreconditioner

    data = task.load()
    torch.manual_seed(0)
    model = task.build_model()
    opt_name = task.defaults.optimizer
    lr = task.defaults.lr[opt_name]
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=lr, momentum=task.defaults.momentum)
        if opt_name == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=lr)
    )
    precond = KFACPreconditioner(model, lr=lambda _: lr) if kfac else None
    batch = task.defaults.batch_size
    pool = [data.train.get_batch(torch.randint(0, len(data.train), (batch,))) for _ in range(8)]
    plain: list[float] = []
    start = 0.0
    for i in range(steps + 10):
        if i == 10:
            start = time.perf_counter()
        x, y = pool[i % len(pool)]
        opt.zero_grad()
        task.loss(model(x), y).backward()
        if precond is not None:
            t = time.perf_counter()
            precond.step()
            if i >= 10 and (i - 1) % 10:  # step() counted from 0: a factor step every 10
                plain.append(time.perf_counter() - t)
        opt.step()
    total = (time.perf_counter() - start) / steps
    return 1e3 * total, 1e3 * statistics.median(plain) if plain else 0.0


def floor_blocks(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(G⁻¹, A⁻¹, ∇)`` stand-ins for every layer K-FAC registers on ``model``.

    The layers and their factor sizes are the preconditioner's own, so
    Conv1d, attention's q/k/v rows and embeddings count as well as Linear and
    Conv2d; a diagonal factor (an embedding's A) is a vector, a scaling."""
    from kaisa import KFACPreconditioner
    from kaisa.core.specs import FactorKind

    precond = KFACPreconditioner(model)
    blocks = []
    for layer in precond.layers.values():
        by_axis = {spec.axis: spec for spec in layer.factors}
        rows, cols = by_axis[0], by_axis[1]
        g_inv, a_inv = (
            torch.randn(spec.dim, spec.dim)
            if spec.kind is FactorKind.DENSE
            else torch.randn(spec.dim)
            for spec in (rows, cols)
        )
        blocks.append((g_inv, a_inv, torch.randn(rows.dim, cols.dim)))
    precond.remove_hooks()
    return blocks


def _floor(model: nn.Module, reps: int = 200) -> float:
    """ms of every registered layer's ``G⁻¹ ∇ A⁻¹`` and ``⟨V, ∇⟩`` (:func:`floor_blocks`)."""
    blocks = floor_blocks(model)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            for g_inv, a_inv, grad in blocks:
                v = g_inv @ grad if g_inv.dim() == 2 else grad * g_inv[:, None]
                v = v @ a_inv if a_inv.dim() == 2 else v * a_inv
                torch.vdot(v.reshape(-1), grad.reshape(-1))
        times.append((time.perf_counter() - start) / reps)
    return 1e3 * statistics.median(times)


def measure(tasks: list[str], steps: int) -> dict[str, dict[str, float]]:
    try:
        from kaisa_lab.tasks.registry import get_task
    except ImportError:  # a --before tree from when the tasks were kaisa.tasks
        from kaisa.tasks.registry import get_task  # type: ignore[no-redef]

    out = {}
    for name in tasks:
        task = get_task(name)
        first, _ = _steps(task, False, steps)
        mean, plain = _steps(task, True, steps)
        torch.manual_seed(0)
        out[name] = dict(zip(METRICS, (first, mean, plain, _floor(task.build_model()))))
    return out


def _table(figures: dict[str, dict[str, float]]) -> None:
    print(f"{'task':<12}" + "".join(f"{m:>20}" for m in METRICS) + f"{'K-FAC / first':>15}")
    for name, row in figures.items():
        ratio = row["K-FAC, mean"] / row["first-order"]
        print(f"{name:<12}" + "".join(f"{row[m]:20.3f}" for m in METRICS) + f"{ratio:15.2f}")


def _plot(rows: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(rows)
    tasks = list(rows[labels[0]])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        width = 0.8 / len(labels)
        for j, label in enumerate(labels):
            values = [rows[label][task][m] for m in METRICS]
            xs = [i + j * width for i in range(len(METRICS))]
            ax.bar(xs, values, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(METRICS))])
        ax.set_xticklabels(METRICS, rotation=30, ha="right", fontsize=8)
        ax.set_title(task)
        ax.set_ylabel("ms per step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _single(args: argparse.Namespace, src: Path) -> dict[str, dict[str, float]]:
    # the tree's library and, where it has one, its harness (lab/src: the tasks)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(src.parent / "lab" / "src")]))
    cmd = [sys.executable, __file__, "--single", "--threads", str(args.threads)]
    cmd += ["--steps", str(args.steps), "--tasks", *args.tasks]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    figures: dict[str, dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["digits-mlp", "digits-cnn", "digits-ae"])
    parser.add_argument("--steps", type=int, default=200, help="timed steps (a multiple of 100)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--before", type=Path, help="a kaisa tree (with src/) to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.single:
        from kaisa import tune_cpu_allocator

        tune_cpu_allocator()
        print(json.dumps(measure(args.tasks, args.steps)))
        return
    trees = {"after": Path(__file__).resolve().parents[1] / "src"}
    if args.before is not None:
        trees = {"before": args.before / "src", **trees}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {label: [] for label in trees}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for label, src in trees.items():
            runs[label].append(_single(args, src))
            print(f"round {r + 1}/{args.rounds} {label} done", flush=True)
    medians = {
        label: {
            task: {m: statistics.median(run[task][m] for run in found) for m in METRICS}
            for task in args.tasks
        }
        for label, found in runs.items()
    }
    for label, figures in medians.items():
        print(f"\n{label} (median of {args.rounds} processes, ms per step)")
        _table(figures)
    meta = {
        "torch": torch.__version__,
        "threads": args.threads,
        "steps": args.steps,
        "rounds": args.rounds,
        "load_1min": [load, os.getloadavg()[0]],
        "kfac": "library defaults (inverse, factors every 10 steps, inverses every 100)",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "medians": medians, "runs": runs}
    (args.out / "task_steps.json").write_text(json.dumps(payload, indent=2))
    _plot(medians, args.out / "task_steps.png")
    print(f"wrote {args.out / 'task_steps.json'} and {args.out / 'task_steps.png'}")


if __name__ == "__main__":
    main()
