"""Memory vs communication across gradient-worker fractions (the SC'21 trade-off).

Run under torchrun, e.g. on CPU with gloo::

    torchrun --nproc_per_node=4 benchmarks/strategies.py --out runs/bench

For every fraction allowed at this world size it trains a few steps of a
ResNet-style CNN on random data and records, per rank: the K-FAC memory
(factors, second-order tensors), the bytes and calls of every collective kind
on inverse-update and on ordinary steps, and the time of ``precond.step()``.
It also measures what reducing factors to their owner saves over the
all-reduce used by kfac-pytorch: the factor memory every rank would hold, and
the time of one ``reduce`` vs one ``all_reduce`` of the same payload.

Rank 0 prints a table, writes ``strategies.json`` and ``strategies.png``.
With ``--markdown`` it prints only the memory and bytes of each fraction as a
markdown table and writes nothing: no timing, so the table is exactly
reproducible, and docs/benchmarks.md holds it in a region that
``tools/docs_check.py`` re-runs (with fewer steps: the bytes of an ordinary
and of an inverse step and the memory are the same at every step count that
has both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.distributed.plan import allowed_fractions


def model_for_bench(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def measure(fraction: float, args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    model = model_for_bench(args.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    precond = KFACPreconditioner(
        model,
        optimizer=opt,
        grad_worker_fraction=fraction,
        factor_update_steps=1,
        inv_update_steps=args.inv_update_steps,
    )
    g = torch.Generator().manual_seed(rank)
    times: list[float] = []
    inverse_steps: list[dict[str, Any]] = []
    plain_steps: list[dict[str, Any]] = []
    for step in range(args.steps):
        x = torch.randn(args.batch, 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        dist.barrier()
        start = time.perf_counter()
        precond.step()
        elapsed = time.perf_counter() - start
        opt.step()
        if step > 0:  # the first step pays one-time costs
            times.append(elapsed)
        comm = precond.comm_stats()["step"]
        (inverse_steps if step % args.inv_update_steps == 0 else plain_steps).append(comm)
    memory = precond.memory_usage()

    def mean_bytes(steps: list[dict[str, Any]]) -> dict[str, float]:
        kinds = {k for s in steps for k in s}
        return {k: statistics.mean(s.get(k, {}).get("bytes", 0) for s in steps) for k in kinds}

    return {
        "fraction": fraction,
        "grad_workers": precond.plan.grad_workers,
        "memory": memory,
        "step_time_s": statistics.median(times),
        "bytes_inverse_step": mean_bytes(inverse_steps),
        "bytes_plain_step": mean_bytes(plain_steps),
        "factor_bytes_if_allreduced": sum(
            4 * (la.adapter.a_dim**2 + la.adapter.g_dim**2) for la in precond.layers.values()
        ),
    }


def reduce_vs_allreduce(numel: int, repeats: int = 5) -> dict[str, float]:
    """Median seconds of one reduce and one all-reduce of ``numel`` float32."""
    buf = torch.ones(numel)
    out: dict[str, float] = {}
    for name, op in (
        ("reduce_s", lambda: dist.reduce(buf, dst=0)),
        ("all_reduce_s", lambda: dist.all_reduce(buf)),
    ):
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            op()
            samples.append(time.perf_counter() - start)
        out[name] = statistics.median(samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--inv-update-steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print only the memory and bytes table in markdown (no timings), write nothing",
    )
    args = parser.parse_args()
    if args.steps < 2 or args.steps <= args.inv_update_steps:
        raise SystemExit(
            f"--steps must exceed --inv-update-steps ({args.inv_update_steps}) and 1, "
            f"so that ordinary and inverse steps are both measured; got {args.steps}"
        )
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("run me under torchrun, e.g. torchrun --nproc_per_node=4 " + __file__)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for fraction in sorted(allowed_fractions(world), reverse=True):
        mine = measure(fraction, args, rank, world)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        results.append({"fraction": fraction, "ranks": gathered})
    if args.markdown:
        if rank == 0:
            print("\n".join(markdown(results, world)))
        dist.destroy_process_group()
        return
    factor_numel = results[0]["ranks"][0]["factor_bytes_if_allreduced"] // 4
    timing = reduce_vs_allreduce(factor_numel)
    if rank == 0:
        report(results, timing, world, args)
    dist.destroy_process_group()


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per fraction: the largest rank's memory and rank 0's bytes."""
    rows = []
    for entry in results:
        ranks = entry["ranks"]
        rows.append(
            {
                "fraction": entry["fraction"],
                "grad_workers": ranks[0]["grad_workers"],
                "max_rank_memory_mb": max(r["memory"]["total"] for r in ranks) / 2**20,
                "max_rank_second_order_mb": max(r["memory"]["second_order"] for r in ranks) / 2**20,
                "max_rank_factors_mb": max(r["memory"]["factors"] for r in ranks) / 2**20,
                "max_rank_workspace_mb": max(r["memory"]["workspace"] for r in ranks) / 2**20,
                "factors_if_allreduced_mb": ranks[0]["factor_bytes_if_allreduced"] / 2**20,
                "mb_per_plain_step": sum(ranks[0]["bytes_plain_step"].values()) / 2**20,
                "mb_per_inverse_step": sum(ranks[0]["bytes_inverse_step"].values()) / 2**20,
                "median_step_s": max(r["step_time_s"] for r in ranks),
            }
        )
    return rows


#: the columns of :func:`markdown`'s memory, keys of ``memory_usage()``
MEMORY_KINDS = ("total", "second_order", "factors", "workspace")


def fraction_label(fraction: float, world: int) -> str:
    """``1 (COMM-OPT)``, ``1/2 (HYBRID-OPT)``, ``1/4 (MEM-OPT)``, ..."""
    if fraction == 1:
        return "1 (COMM-OPT)"
    name = "MEM-OPT" if round(fraction * world) == 1 else "HYBRID-OPT"
    return f"1/{round(1 / fraction)} ({name})"


def markdown(results: list[dict[str, Any]], world: int) -> list[str]:
    """The memory and bytes table of docs/benchmarks.md, in bytes: each
    memory column its largest rank, traffic what rank 0 sends or contributes."""
    lines = [
        "| grad_worker_fraction | workers/layer | K-FAC bytes / rank | 2nd-order | factors "
        "| workspace | factors if all-reduced | bytes / ordinary step | bytes / inverse step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in results:
        ranks = entry["ranks"]
        memory = [max(r["memory"][k] for r in ranks) for k in MEMORY_KINDS]
        rank0 = ranks[0]
        sent = [
            sum(rank0["bytes_plain_step"].values()),
            sum(rank0["bytes_inverse_step"].values()),
        ]
        cells = [fraction_label(entry["fraction"], world), str(rank0["grad_workers"])]
        cells += [f"{b:,.0f}" for b in (*memory, rank0["factor_bytes_if_allreduced"], *sent)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(results: list[dict[str, Any]], timing: dict[str, float], world: int, args: Any) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    rows = summarise(results)
    header = (
        f"{'f':>6} {'workers':>7} {'mem/rank MB':>12} {'2nd-ord MB':>11} {'factors MB':>11} "
        f"{'(allreduce)':>12} {'MB/step':>9} {'MB/inv step':>12} {'step s':>8}"
    )
    print(f"world size {world}, inv_update_steps {args.inv_update_steps}, batch {args.batch}/rank")
    print(header)
    for r in rows:
        print(
            f"{r['fraction']:>6.3g} {r['grad_workers']:>7} {r['max_rank_memory_mb']:>12.3f} "
            f"{r['max_rank_second_order_mb']:>11.3f} {r['max_rank_factors_mb']:>11.3f} "
            f"{r['factors_if_allreduced_mb']:>12.3f} {r['mb_per_plain_step']:>9.3f} "
            f"{r['mb_per_inverse_step']:>12.3f} {r['median_step_s']:>8.4f}"
        )
    print(
        f"factor payload: reduce {timing['reduce_s'] * 1e3:.2f} ms vs all_reduce "
        f"{timing['all_reduce_s'] * 1e3:.2f} ms (gloo, {world} ranks)"
    )
    payload = {
        "world_size": world,
        "args": vars(args) | {"out": str(args.out)},
        "rows": rows,
        "reduce_vs_allreduce": timing,
        "raw": results,
    }
    (args.out / "strategies.json").write_text(json.dumps(payload, indent=2, default=str))
    (args.out / f"strategies_w{world}.json").write_text(json.dumps(payload, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    fr = [r["fraction"] for r in rows]
    ax.plot(fr, [r["max_rank_memory_mb"] for r in rows], "o-", label="K-FAC memory / rank (MB)")
    ax.plot(fr, [r["mb_per_plain_step"] for r in rows], "s-", label="traffic / ordinary step (MB)")
    ax.plot(fr, [r["mb_per_inverse_step"] for r in rows], "^-", label="traffic / inverse step (MB)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("grad_worker_fraction")
    ax.set_title(f"KAISA memory vs communication, {world} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "strategies.png", dpi=120)
    plt.close(fig)
    memory_vs_traffic(args.out, plt)


def memory_vs_traffic(out: Path, plt: Any) -> None:
    """Per-rank memory against bytes per step, one line per world size run so
    far into ``out`` (``strategies_w*.json``), each point a fraction: the
    trade-off of the SC'21 paper's Fig. 6.3."""
    runs = sorted(
        (json.loads(p.read_text()) for p in out.glob("strategies_w*.json")),
        key=lambda r: r["world_size"],
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        rows = sorted(run["rows"], key=lambda r: r["fraction"])
        steps = max(1, int(run["args"].get("inv_update_steps", 1)))
        # bytes per step averaged over an inverse-update interval
        traffic = [
            (r["mb_per_inverse_step"] + (steps - 1) * r["mb_per_plain_step"]) / steps for r in rows
        ]
        memory = [r["max_rank_memory_mb"] for r in rows]
        ax.plot(traffic, memory, "o-", label=f"W = {run['world_size']}")
        for x, y, r in zip(traffic, memory, rows):
            ax.annotate(
                f"f={r['fraction']:g}",
                (x, y),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 4),
            )
    ax.set_xlabel("MB sent per rank per step (averaged over an inverse interval)")
    ax.set_ylabel("K-FAC memory per rank (MB)")
    ax.set_title("KAISA: memory vs communication across grad_worker_fraction")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "strategies-memory-vs-comm.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
